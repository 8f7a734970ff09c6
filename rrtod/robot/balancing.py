"""The host balancer the configuration selects, built and checked in one place.

``balancer: NAME`` picks the plugin; ``balancers: {NAME: {option: value}}`` holds per-plugin
options. The chosen plugin's block goes to its factory as ``factory(options, state_dir)``
(``rrtod.hookspecs.BalancerFactory``), which validates it; ``state_dir`` is
``<state_dir>/balancers``, created by a balancer only when it writes. Everything that can be wrong
is reported as a ``ConfigError`` naming the file, the dotted key and the reason (``rrtod.yaml:
balancers.q-learning.alpha: Input should be less than or equal to 1``), so that ``rrtod
--check-config``, start and SIGHUP reload (which keeps the running config) all say the same.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import structlog
from pydantic import ValidationError

from rrtod.config import Config, ConfigError, explain
from rrtod.hookspecs import BalancerFactory, HostBalancer, problems
from rrtod.plugins import PluginError, Registry

log = structlog.get_logger("rrtod.robot")

FileOf = Callable[[str], str]


def state_dir(config: Config) -> Path:
    """Where balancers keep what they learn (not created here)."""
    return Path(config.state_dir) / "balancers"


def selection(config: Config) -> tuple[str, dict[str, object] | None]:
    """What decides the balancer: its name and its options block (a reload that changes
    neither keeps the running balancer, and what it has learned)."""
    return config.balancer, config.balancers.get(config.balancer)


def check_blocks(config: Config, registry: Registry, file_of: FileOf) -> None:
    """Every ``balancers`` block names an installed balancer: a typo there would otherwise
    leave the chosen balancer on its defaults without a word."""
    installed = registry.names("balancer")
    for name in config.balancers:
        if name not in installed:
            key = f"balancers.{name}"
            raise ConfigError(file_of(key), key, f"no balancer plugin named {name!r} "
                                                 f"(installed: {', '.join(installed) or 'none'})")


def build_balancer(registry: Registry, config: Config,
                   file_of: FileOf = lambda key: "<config>") -> HostBalancer:
    """The balancer ``config`` selects, built with its options. Raises ConfigError."""
    name = config.balancer
    try:
        record = registry.get("balancer", name)
    except PluginError as exc:
        raise ConfigError(file_of("balancer"), "balancer", str(exc)) from None
    key = f"balancers.{name}"
    why = problems(record.factory, BalancerFactory)
    if why:
        raise ConfigError(file_of("balancer"), "balancer",
                          f"balancer plugin {name!r}: its factory {'; '.join(why)} (a "
                          f"rrtod.hookspecs.BalancerFactory is called as factory(options, "
                          f"state_dir))")
    try:
        built = record.factory(dict(config.balancers.get(name, {})), state_dir(config))
    except ValidationError as exc:
        option, reason = explain(exc)
        full = f"{key}.{option}" if option else key
        raise ConfigError(file_of(full), full, reason) from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(file_of(key), key, str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - a plugin's bug: the operator needs its name
        raise ConfigError(file_of("balancer"), "balancer",
                          f"balancer plugin {name!r} failed to build: {exc!r}") from None
    missing = problems(built, HostBalancer)
    if missing:
        raise ConfigError(file_of("balancer"), "balancer",
                          f"balancer plugin {name!r} built {type(built).__name__}, which is not "
                          f"an rrtod.hookspecs.HostBalancer ({', '.join(missing)}): derive it "
                          f"from rrtod.hookspecs.BalancerBase")
    return built


def check_balancer(config: Config, registry: Registry, file_of: FileOf) -> None:
    """What start, reload and ``--check-config`` verify: the blocks name installed balancers,
    and the chosen one builds with its options. The object built is dropped, not closed
    (closing would persist its freshly loaded state over the running balancer's)."""
    check_blocks(config, registry, file_of)
    build_balancer(registry, config, file_of)


def close_balancer(balancer: HostBalancer) -> None:
    """``close()``, whose failure is logged: it must not stop a reload or a shutdown."""
    try:
        balancer.close()
    except Exception:  # noqa: BLE001
        log.exception("host balancer close failed", balancer=type(balancer).__name__)
