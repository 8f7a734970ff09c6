"""Activation of offloading inside an unmodified app's interpreter.

Two ways in, both ending in ``boot.install()``:
- ``rrto-run CMD...`` (rrtod.run) sets ``RRTO_OFFLOAD=1`` and puts a generated ``sitecustomize``
  first on ``PYTHONPATH``; it chains to any existing ``sitecustomize``.
- ``RRTO_OFFLOAD=1`` in the environment (systemd units, ROS launch files) with the
  ``rrto_offload.pth`` hook installed in site-packages (``rrto-run --install-hook``).

``boot`` is import-light: it only watches for ``import torch``. Programs that never import torch
pay one environment lookup. When torch finishes importing, ``activate`` connects to the robot
daemon and installs the configured interception backend, or warns once and runs locally.
"""

ENV = "RRTO_OFFLOAD"
