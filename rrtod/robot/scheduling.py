"""The configured scheduler (``scheduler:``), applied to each sequence the robot defines.

Before a verified sequence goes to the host (``AppRelay.push_sequence``) the scheduler places
its calls (``rrtod.partition``): the definition the host and the shim then replay says which
calls the robot runs. A placement that could change a result, or one the scheduler fails to
make, is logged and the sequence runs on the host whole: placing is an optimisation, never a
reason to lose replay.

A scheduler that never places a call on the robot says so (``splits = False``, as
``remote-all`` does): then nothing is analysed, and the interception backend's aliasing (for
torch, an import of torch into the daemon) is never loaded.
"""

from __future__ import annotations

from typing import Any

import structlog

from rrto.v1 import ops_pb2
from rrtod import partition
from rrtod.config import Config
from rrtod.plugins import Registry

log = structlog.get_logger("rrtod.robot")


class Scheduling:
    """The scheduler and the backend's aliasing it places with; rebuilt by ``RobotRole`` when
    a reload changes ``scheduler``."""

    def __init__(self, registry: Registry, config: Config):
        self.name = config.scheduler
        self.scheduler = registry.get("scheduler", config.scheduler).factory()
        self.splits = bool(getattr(self.scheduler, "splits", True))
        self._backend = registry.get("interception", config.intercept.backend)
        self._aliasing: tuple[partition.Written, partition.Viewed] | None = None
        self.placed = 0  # sequences defined with calls on the robot
        self.refused = 0  # placements refused (or failed): run on the host whole

    def place(self, d: ops_pb2.SequenceDef, link: Any = None) -> ops_pb2.SequenceDef:
        """``d`` as the scheduler places it (``d`` itself when everything runs on the host)."""
        if not self.splits or not d.calls or partition.why_not_split(d) is not None:
            return d
        aliasing = self._load_aliasing()
        if aliasing is None:
            return d
        written, viewed = aliasing
        try:
            view = partition.view(d, written, viewed)
            placement = list(self.scheduler.place(view, link))
            placed = partition.split(d, placement, written, viewed)
        except Exception as exc:  # noqa: BLE001 - a plugin's failure must not cost replay
            self.refused += 1
            log.warning("placement refused: the sequence runs on the host", scheduler=self.name,
                        sequence=d.id, reason=str(exc))
            return d
        if placed.robot_calls:
            self.placed += 1
            log.info("sequence placed", scheduler=self.name, sequence=d.id,
                     robot_calls=len(placed.robot_calls), calls=len(d.calls))
        return placed

    def _load_aliasing(self) -> tuple[partition.Written, partition.Viewed] | None:
        if self._aliasing is None:
            factory = getattr(self._backend, "aliasing", None)
            if factory is None:
                return None
            self._aliasing = factory()
        return self._aliasing

    def describe(self) -> dict[str, Any]:
        return {"scheduler": self.name, "placed": self.placed, "refused": self.refused}
