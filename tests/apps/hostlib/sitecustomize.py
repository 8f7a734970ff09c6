"""Test GPU daemons start with this directory on PYTHONPATH: give the host the test library's
dispatcher operators (the app registers the same ones itself)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import rrtotest_ops  # noqa: E402,F401

rrtotest_ops.register_blend(version=1)  # the skewed_op app has version 2
