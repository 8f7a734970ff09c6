"""rrtod: transparent offloading of ML inference from robots to GPU hosts by record/replay."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("rrtod")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"
