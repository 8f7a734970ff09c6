"""``make demo``: what offloading gives a robot, shown on one machine (see ``demo.__main__``).

A script of the repository, not part of the installed ``rrtod`` package: it drives the example
app in ``examples/`` through the benchmark's link emulator (``bench/link.py``), neither of which
is packaged. Run it from the repository root: ``make demo`` or ``.venv/bin/python -m demo``.
"""
