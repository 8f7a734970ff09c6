"""App idioms that real inference loops use, each a small app around an offloaded model
(compat/idioms/run.py). torch only (no torchvision), so the fast tier's torch 2.13 CPU venv can
run them too; the corpus runs them like its models, locally and under ``rrto-run``."""

from compat.idioms.apps import IDIOMS

__all__ = ["IDIOMS"]
