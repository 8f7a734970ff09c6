"""``rrtod``: the daemon. Loads config and plugins, runs the robot and/or gpu role, serves the
unix socket, and speaks systemd's notify protocol.

Signals: SIGHUP reloads the configuration atomically (an invalid file keeps the old config and
logs why); SIGTERM/SIGINT drain (no new sessions, running ones get ``drain_timeout`` seconds)
and exit 0. Exit status 78 (EX_CONFIG) means the configuration is wrong: the unit file does not
restart on it, because restarting cannot fix a typo.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import structlog

from rrto.v1 import local_pb2
from rrtod import __version__, gcfreeze, heap
from rrtod import config as config_mod
from rrtod import log as log_setup
from rrtod.config import Config, ConfigError, LoadedConfig
from rrtod.grpc_options import prefer_polling_engine
from rrtod.local_server import Cred, LocalServer
from rrtod.plugins import PluginError, Registry, discover
from rrtod.robot.balancing import check_balancer
from rrtod.robot.energy import EnergyAccountant, select_meter
from rrtod.robot.sequences import SequenceStore
from rrtod.sdnotify import Notifier

log = structlog.get_logger("rrtod")

EX_CONFIG = 78
# Keys that bind sockets or identity: changing them needs a restart, a reload keeps the old value.
RESTART_KEYS = ("roles", "node", "socket", "socket_mode", "socket_limits", "state_dir", "listen",
                "health_listen", "tls")


def check_plugins(loaded: LoadedConfig, registry: Registry) -> None:
    """Every plugin the config names must exist, and the balancer must build with its options
    (``balancers.<name>``); the error names the file and key."""
    for key, family, name in loaded.config.plugin_choices():
        try:
            registry.get(family, name)
        except PluginError as exc:
            raise ConfigError(loaded.file_of(key), key, str(exc)) from None
    if "robot" in loaded.config.roles:
        check_balancer(loaded.config, registry, loaded.file_of)


class Daemon:
    def __init__(self, loaded: LoadedConfig, registry: Registry):
        self.loaded = loaded
        self.registry = registry
        self.started = time.time()
        self.notifier = Notifier()
        self.stop_event = asyncio.Event()
        self.robot: Any = None
        self.gpu: Any = None
        self.energy: Any = None
        self.local: LocalServer | None = None
        self.metrics_server: Any = None
        self.reloads = 0
        self._tasks: list[asyncio.Task[Any]] = []

    @property
    def config(self) -> Config:
        return self.loaded.config

    @property
    def sequences(self) -> SequenceStore:
        return SequenceStore(Path(self.config.state_dir) / "sequences")

    # ----- lifecycle -----
    async def run(self) -> int:
        cfg = self.config
        loop = asyncio.get_running_loop()
        Path(cfg.state_dir).mkdir(parents=True, exist_ok=True)
        if "gpu" in cfg.roles:
            from rrtod.gpu.service import GpuRole

            self.gpu = GpuRole(cfg, self.registry)
            await self.gpu.start()
        if "robot" in cfg.roles:
            from rrtod.robot.role import RobotRole

            self.energy = self._start_energy()
            self.robot = RobotRole(cfg, self.registry, self.energy)
            await self.robot.start()
        self.local = LocalServer(cfg.socket, cfg.socket_mode, self.control,
                                 self.robot.serve_app if self.robot else None, cfg.socket_limits)
        await self.local.start()
        self._start_metrics()
        for sig, handler in ((signal.SIGHUP, self._on_hup), (signal.SIGTERM, self.stop_event.set),
                             (signal.SIGINT, self.stop_event.set)):
            loop.add_signal_handler(sig, handler)
        interval = self.notifier.watchdog_interval()
        if interval:
            self._tasks.append(loop.create_task(self._watchdog(interval)))
        gcfreeze.settle()  # modules, plugins and roles: kept for the daemon's life
        heap.keep_freed_memory()  # replays free and allocate an inference's worth each time
        log.info("rrtod started", version=__version__, roles=list(cfg.roles), node=cfg.node,
                 socket=cfg.socket, config=[str(f) for f in self.loaded.files])
        self.notifier.ready(self._status_line())
        await self.stop_event.wait()
        await self.shutdown()
        return 0

    def _start_energy(self) -> Any:
        try:
            name, meter = select_meter(self.registry, self.config.power)
        except Exception as exc:  # noqa: BLE001 - no meter is not fatal: status says why
            log.warning("no power meter", error=str(exc))
            return None
        accountant = EnergyAccountant(name, meter, self.config.power.sample_hz)
        self._tasks.append(asyncio.get_running_loop().create_task(accountant.run()))
        return accountant

    def _start_metrics(self) -> None:
        listen = self.config.metrics.listen
        if not listen:
            return
        from rrtod.metrics import serve

        host, _, port = listen.rpartition(":")
        try:
            self.metrics_server = serve(self, host, int(port))
        except OSError as exc:
            log.warning("metrics endpoint unavailable", listen=listen, error=str(exc))

    async def _watchdog(self, interval: float) -> None:
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(interval)

    async def shutdown(self) -> None:
        cfg = self.config
        log.info("draining", timeout=cfg.drain_timeout)
        self.notifier.stopping()
        if self.local:
            self.local.stop_accepting()
        if self.robot:
            self.robot.draining = True
        if self.gpu:
            await self.gpu.drain()
        deadline = time.monotonic() + cfg.drain_timeout
        while time.monotonic() < deadline and self._session_count():
            await asyncio.sleep(0.05)
        if self.local:
            await self.local.close()
        if self.robot:
            await self.robot.stop()
        if self.gpu:
            await self.gpu.stop(grace=0.5)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
        log.info("rrtod stopped")

    def _session_count(self) -> int:
        return (len(self.robot.sessions) if self.robot else 0) + (
            len(self.gpu.sessions) if self.gpu else 0)

    # ----- reload -----
    def _on_hup(self) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(self.reload()))

    async def reload(self) -> bool:
        self.notifier.reloading()
        old = self.loaded
        try:
            new = config_mod.load(old.path)
            check_plugins(new, self.registry)
        except ConfigError as exc:
            log.error("reload failed, keeping the running configuration", error=str(exc))
            self.notifier.ready(self._status_line())
            return False
        pinned = {k: getattr(old.config, k) for k in RESTART_KEYS
                  if getattr(new.config, k) != getattr(old.config, k)}
        if pinned:
            log.warning("changed keys need a restart; keeping their running values",
                        keys=sorted(pinned))
            new = LoadedConfig(new.config.model_copy(update=pinned), new.files, new.origin)
        log_setup.setup(new.config.log.format, new.config.log.level)
        if self.robot:
            await self.robot.reload(new.config)
        if self.gpu:
            self.gpu.reload(new.config)
        self.loaded = new
        self.reloads += 1
        log.info("configuration reloaded", files=[str(f) for f in new.files])
        self.notifier.ready(self._status_line())
        return True

    # ----- control (rrtoctl) -----
    def _sequences(self) -> list[dict[str, Any]]:
        """Saved sequences, with the live counters of those in use by a session."""
        by_id = {s.get("id"): s for s in self.sequences.list()}
        if self.robot:
            for session in self.robot.sessions.values():
                if session.recorder is None:
                    continue
                placement = session.placement
                for live in session.recorder.sequences.values():
                    saved = by_id.get(live["id"], {})
                    where = placement.sequence_placement(live["id"]) if placement else None
                    if where is not None:  # which hosts serve it; why it is pinned, if it is
                        live = {**live, **where}
                    by_id[live["id"]] = {**saved, **live,
                                         "replays": saved.get("replays", 0) + live["replays"],
                                         "mismatches": saved.get("mismatches", 0)
                                         + live["mismatches"], "live": True}
        return sorted(by_id.values(), key=lambda s: (s.get("app", ""), s.get("created", 0)))

    def _status_line(self) -> str:
        parts = [f"roles={'+'.join(self.config.roles)}"]
        if self.robot:
            up = sum(h.up for h in self.robot.hosts.values())
            parts.append(f"hosts up {up}/{len(self.robot.hosts)}")
        parts.append(f"sessions {self._session_count()}")
        return ", ".join(parts)

    def status(self) -> dict[str, Any]:
        cfg = self.config
        out: dict[str, Any] = {
            "version": __version__,
            "node": cfg.node,
            "roles": list(cfg.roles),
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started, 3),
            "config": {"path": str(self.loaded.path), "files": [str(f) for f in self.loaded.files],
                       "reloads": self.reloads},
            "socket": cfg.socket,
            "connections": self.local.describe() if self.local else None,
            "plugins": {fam: self.registry.names(fam) for fam in self.registry.families},
            "selected": {key: name for key, _, name in cfg.plugin_choices()},
            "hosts": [],
            "sessions": [],
        }
        if self.robot:
            out.update(self.robot.describe())
        if self.gpu:
            out["gpu"] = self.gpu.describe()
        out["power"] = self.energy.describe() if self.energy is not None else None
        return out

    async def control(self, request: local_pb2.CtlRequest, cred: Cred) -> local_pb2.CtlReply:
        args = dict(request.args)
        try:
            if request.command == "status":
                result: Any = self.status()
            elif request.command == "plugins":
                result = self.registry.describe()
            elif request.command == "sequences":
                result = {"sequences": self._sequences()}
            elif request.command == "flush":
                app = None if args.get("all") == "1" else args.get("app")
                if app is None and args.get("all") != "1":
                    return local_pb2.CtlReply(ok=False, error="flush needs --app NAME or --all")
                live = await self.robot.flush(app) if self.robot else 0
                saved = self.sequences.flush(app)
                result = {"flushed": max(live, saved), "saved": saved, "live": live, "app": app}
                log.info("sequences flushed", app=app, count=result["flushed"], uid=cred[1])
            elif request.command == "reload":
                result = {"reloaded": await self.reload()}
            else:
                return local_pb2.CtlReply(ok=False, error=f"unknown command {request.command!r}")
        except Exception as exc:  # noqa: BLE001 - rrtoctl gets the error; the daemon carries on
            log.exception("control command failed", command=request.command)
            return local_pb2.CtlReply(ok=False, error=repr(exc))
        return local_pb2.CtlReply(ok=True, json=json.dumps(result, default=str))


def _run_loop(main: Any) -> int:
    """Run the daemon on uvloop where it is installed, else on asyncio's own loop.

    Every frame of a replayed inference wakes each daemon's loop a few times (the app's socket,
    gRPC's completion-queue thread, the session's worker thread); uvloop's wake-ups and socket
    transports cost less Python per wake-up. Measured with ``python -m bench.plumbing`` on the
    2-core test machine: a replayed mlp inference 1.93 -> 1.75 ms, and about 0.05 ms less
    robot and GPU daemon CPU per inference. ``RRTO_EVENT_LOOP=asyncio`` forces the stdlib loop.
    """
    if os.environ.get("RRTO_EVENT_LOOP", "uvloop") != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                return runner.run(main)
    return asyncio.run(main)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rrtod", description="rrtod: transparent ML offloading daemon")
    p.add_argument("--config", help=f"main config file (default ${config_mod.ENV_PATH} or "
                                    f"{config_mod.DEFAULT_PATH})")
    p.add_argument("--check-config", action="store_true",
                   help="validate the configuration and plugins, then exit")
    p.add_argument("--version", action="version", version=f"rrtod {__version__}")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    prefer_polling_engine()  # before plugin discovery imports grpc
    try:
        loaded = config_mod.load(args.config)
        log_setup.setup(loaded.config.log.format, loaded.config.log.level)
        registry = discover()
        check_plugins(loaded, registry)
    except (ConfigError, PluginError) as exc:
        print(f"rrtod: configuration error: {exc}", file=sys.stderr)
        return EX_CONFIG
    if args.check_config:
        print(f"rrtod: configuration ok ({', '.join(str(f) for f in loaded.files)})")
        return 0
    try:
        return _run_loop(Daemon(loaded, registry).run())
    except OSError as exc:
        print(f"rrtod: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
