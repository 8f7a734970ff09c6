"""The one place the corpus imports the repository's daemon launcher from (it is moving out of
the installed package into a testing module; only this import changes when it does)."""

from rrtod.launch import Launcher

__all__ = ["Launcher"]
