"""What the tests, the benchmark and the demo share; not part of the installed ``rrtod``.

pyproject.toml packages ``rrtod``, ``rrto`` and ``rrto_plugins`` only, so neither the wheel nor
an installed system carries this. It is imported from the repository root, as ``bench`` and
``demo`` are: pytest puts the root first on ``sys.path`` (``tests`` is a package, so its parent
is the import root), and ``python -m bench`` / ``python -m demo`` run from the root have it as
their working directory.

- ``daemons``: real ``rrtod`` processes in private temporary directories (``Launcher``).
- ``apps``: the test apps of ``tests/apps``, their environment, and comparison with local runs.
- ``frames``: the frames an app's shim sends, built by hand for the recorder and search.
- ``peer``: raw clients of a daemon's sockets, driven frame by frame as a hostile peer would.
- ``pki``: a throwaway CA and certificates for the peer link's TLS tests.
- ``echo_plugin/``: a directory for a daemon's ``PYTHONPATH`` holding a third-party-style
  plugin (the ``echo`` interception backend) that needs no framework.
"""
