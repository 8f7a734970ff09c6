"""Plugin discovery: entry points of group ``rrto`` -> pluggy -> named records per family.

Rules, because a daemon must start on a robot whatever third-party code is installed:
- a plugin that fails to import, or whose hook raises, is logged and skipped, never fatal;
- two records with the same name in one family are an error that names both distributions,
  since silently picking one would make behaviour depend on install order;
- ``RRTO_DISABLE_PLUGINS=a,b`` skips entry points and records with those names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import pluggy
import structlog

from rrtod import hookspecs
from rrtod.hookspecs import FAMILIES, InterceptionBackend, PluginRecord, PowerMeterRecord
from rrtod.switches import disabled_plugins

log = structlog.get_logger("rrtod.plugins")

DISABLE_ENV = "RRTO_DISABLE_PLUGINS"

# Families whose records carry more than a factory: the daemon reads those extra fields
# (``probe``/``priority``, ``executor``), so a plain PluginRecord there would fail later, far from
# the plugin that made it.
RECORD_TYPES: dict[str, type[PluginRecord]] = {
    "interception": InterceptionBackend,
    "power": PowerMeterRecord,
}


class PluginError(Exception):
    """A plugin configuration problem the operator must fix (duplicate or unknown name)."""


@dataclass(frozen=True)
class Loaded:
    record: PluginRecord
    family: str
    entry_point: str
    distribution: str
    version: str

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.record.name,
            "description": self.record.description,
            "entry_point": self.entry_point,
            "distribution": self.distribution,
            "version": self.version,
        }


@dataclass
class Registry:
    """Every record of every family, with where it came from."""

    families: dict[str, dict[str, Loaded]] = field(
        default_factory=lambda: {f: {} for f in FAMILIES}
    )
    failed: list[dict[str, str]] = field(default_factory=list)
    blocked: list[str] = field(default_factory=list)

    def get(self, family: str, name: str) -> PluginRecord:
        try:
            return self.families[family][name].record
        except KeyError:
            have = ", ".join(sorted(self.families.get(family, {}))) or "none"
            raise PluginError(f"no {family} plugin named {name!r} (installed: {have})") from None

    def names(self, family: str) -> list[str]:
        return sorted(self.families[family])

    def records(self, family: str) -> list[PluginRecord]:
        return [loaded.record for loaded in self.families[family].values()]

    def describe(self) -> dict[str, Any]:
        return {
            "families": {
                fam: [self.families[fam][n].describe() for n in sorted(self.families[fam])]
                for fam in FAMILIES
            },
            "failed": self.failed,
            "blocked": self.blocked,
        }


def _disabled() -> set[str]:
    return set(disabled_plugins())


def _dist_of(ep: EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    return (dist.metadata["Name"], dist.version) if dist is not None else ("<unknown>", "")


def _hook_failed(registry: Registry, ep_name: str, dist: str, hook: str, error: str) -> None:
    log.warning("plugin hook failed, skipped", plugin=ep_name, distribution=dist, hook=hook,
                error=error)
    registry.failed.append({"entry_point": ep_name, "distribution": dist, "error": error})


def discover(extra: dict[str, object] | None = None) -> Registry:
    """Load every ``rrto`` entry point (plus ``extra`` plugin objects, for embedding and tests)
    and collect their records."""
    disabled = _disabled()
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs.Specs)
    registry = Registry(blocked=sorted(disabled))
    # pluggy name -> (entry point name, distribution, version). pluggy names must be unique, but
    # entry point names are only unique within a distribution: two packages may both call theirs
    # "balancers". Registering under "dist:name" keeps both, and genuine conflicts surface as
    # duplicate record names below, naming both distributions.
    origins: dict[str, tuple[str, str, str]] = {}

    sources: list[tuple[str, object | EntryPoint]] = [
        (ep.name, ep) for ep in entry_points(group=hookspecs.PROJECT)
    ]
    sources += list((extra or {}).items())
    for name, source in sources:
        if name in disabled:
            log.info("plugin disabled", plugin=name, env=DISABLE_ENV)
            continue
        dist, ver = _dist_of(source) if isinstance(source, EntryPoint) else ("<embedded>", "")
        key = f"{dist}:{name}"
        try:
            plugin = source.load() if isinstance(source, EntryPoint) else source
            pm.register(plugin, name=key)
        # A broken third-party plugin must not stop the daemon; SystemExit included, since a
        # module calling sys.exit() at import time is just as broken.
        except (Exception, SystemExit) as exc:
            log.warning("plugin failed to load, skipped", plugin=name, distribution=dist,
                        error=repr(exc))
            registry.failed.append({"entry_point": name, "distribution": dist, "error": repr(exc)})
            continue
        origins[key] = (name, dist, ver)

    for family, hook_name in FAMILIES.items():
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            ep_name, dist, ver = origins[impl.plugin_name]
            report = partial(_hook_failed, registry, ep_name, dist, hook_name)
            try:
                result = impl.function()
                if isinstance(result, PluginRecord) or not isinstance(result, list | tuple | None):
                    report(f"{hook_name} returned {type(result).__name__}, not a list of records")
                    continue
                records = list(result or [])
            except (Exception, SystemExit) as exc:
                report(f"{hook_name}: {exc!r}")
                continue
            wanted = RECORD_TYPES.get(family, PluginRecord)
            for record in records:
                if not isinstance(record, wanted):
                    report(f"{hook_name} returned {type(record).__name__}, "
                           f"not a {wanted.__name__}")
                    continue
                if not isinstance(record.name, str) or not record.name:
                    report(f"{hook_name} returned a record without a name: {record!r}")
                    continue
                if record.name in disabled:
                    continue
                seen = registry.families[family].get(record.name)
                if seen is not None:
                    raise PluginError(
                        f"duplicate {family} plugin {record.name!r}: provided by "
                        f"{seen.distribution} ({seen.entry_point}) and {dist} ({ep_name})"
                    )
                registry.families[family][record.name] = Loaded(record, family, ep_name, dist, ver)
    return registry
