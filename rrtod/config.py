"""Daemon configuration: YAML files merged in order, validated into typed, immutable settings.

Files: the main file (default ``/etc/rrto/rrtod.yaml``, or ``--config``/``RRTO_CONFIG``), then
``rrtod.d/*.yaml`` beside it in name order; later files win key by key (mappings merge, lists and
scalars replace). Every validation error names the file that set the key, the key's dotted path
and the reason, because an operator reading a journal line must be able to fix it without
reading code. pydantic does the type checking; this module adds the file attribution.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from rrtod import opnames
from rrtod.wire import MAX_FRAME

DEFAULT_PATH = Path("/etc/rrto/rrtod.yaml")
ENV_PATH = "RRTO_CONFIG"

Role = Literal["robot", "gpu"]


class ConfigError(Exception):
    """A configuration problem, phrased for the operator: file, key, reason."""

    def __init__(self, file: str, key: str, reason: str):
        self.file, self.key, self.reason = file, key, reason
        where = f"{file}: {key}" if key else file
        super().__init__(f"{where}: {reason}")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_address(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    # "::1:7730" is ambiguous (is 7730 part of the address?); gRPC wants IPv6 in brackets.
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ValueError(f"expected HOST:PORT with an IPv6 host in brackets ([::1]:7730), "
                         f"got {value!r}")
    return value


# gRPC's name syntax (dns:[//authority/]host:port) with an empty authority: the system resolver.
DNS_PREFIX = "dns:///"


def _check_peer_address(value: str) -> str:
    """A peer-link address: ``HOST:PORT`` (TCP), ``unix:/absolute/path`` (a local socket) or
    ``dns:///NAME:PORT`` (every address NAME resolves to, each a host: ``rrtod.robot.host_source``)."""
    if value.startswith("unix:"):
        if not value.removeprefix("unix:").startswith("/"):
            raise ValueError(f"expected unix:/absolute/path, got {value!r}")
        return value
    if value.startswith("dns:"):
        if not value.startswith(DNS_PREFIX):
            raise ValueError(f"expected {DNS_PREFIX}NAME:PORT (no DNS server can be named: the "
                             f"system resolver answers), got {value!r}")
        try:
            _check_address(value.removeprefix(DNS_PREFIX))
        except ValueError:
            raise ValueError(f"expected {DNS_PREFIX}NAME:PORT, got {value!r}") from None
        return value
    return _check_address(value)


def is_unix(address: str) -> bool:
    return address.startswith("unix:")


def is_dns(address: str) -> bool:
    return address.startswith(DNS_PREFIX)


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as ``512MiB``, ``2GiB``, ``1.5G``."""
    if isinstance(value, bool):  # YAML "yes"/"true" is an int subclass: not a size
        raise ValueError(f"expected a size such as 512MiB or 2GiB, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("size must be >= 0")
        return value
    text = str(value).strip()
    units = {
        "": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
        "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
        "tib": 2**40,
    }
    number = text.rstrip("kKmMgGtTiIbB ")
    unit = text[len(number):].strip().lower()
    try:
        amount = float(number)
    except ValueError:
        raise ValueError(f"expected a size such as 512MiB or 2GiB, got {value!r}") from None
    if unit not in units or amount < 0:
        raise ValueError(f"expected a size such as 512MiB or 2GiB, got {value!r}")
    return int(amount * units[unit])


class HostConfig(_Section):
    """A GPU daemon this robot daemon offloads to; with a ``dns:///NAME:PORT`` address, every
    GPU daemon at an address NAME resolves to."""

    name: str = Field(min_length=1)
    address: str
    transport: str = "grpc"  # transport plugin that opens the channel
    refresh: float = Field(default=10.0, gt=0, le=3600)  # dns: seconds between resolutions

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if "/" in v:
            raise ValueError("must not contain '/' (it joins a dns: host's name and each address)")
        return v

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        return _check_peer_address(v)

    @model_validator(mode="after")
    def _refresh_for_dns(self) -> HostConfig:
        if "refresh" in self.model_fields_set and not is_dns(self.address):
            raise ValueError(f"refresh: only a {DNS_PREFIX}NAME:PORT address is resolved again")
        return self


class TLSConfig(_Section):
    """Security of peer links over TCP. ``mtls`` (default) and ``tls`` need certificate paths;
    ``insecure`` sends everything in plaintext and is only honoured because the operator wrote
    it. Unix-socket peer links ignore this section: the socket's file mode is their access
    control. The certificate paths are required only where a TCP link uses them (see
    ``Config._tls_for_tcp``), so the single-machine default needs no certificate."""

    mode: Literal["mtls", "tls", "insecure"] = "mtls"
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None  # override the name checked in the host's certificate

    def missing(self) -> str | None:
        """Why these settings cannot secure a TCP link, or None."""
        needed = {"mtls": ("ca", "cert", "key"), "tls": ("ca",), "insecure": ()}[self.mode]
        for name in needed:
            if not getattr(self, name):
                return f"tls.{name}: required when tls.mode is {self.mode!r}"
        if self.mode == "tls" and bool(self.cert) != bool(self.key):
            return "tls: cert and key: give both or neither"
        return None


def _check_operators(v: Any, extra: bool) -> Any:
    """Operator entries of an allowlist key (``executor.allow_extra``/``deny``, an access rule's
    ``allow_extra``): an unsafe operator needs the ``unsafe:`` marker wherever it is added."""
    if not isinstance(v, (list, tuple)):
        return v  # pydantic reports "expected a list"
    for i, entry in enumerate(v):
        why = opnames.check_entry(entry, extra=extra)
        if why is not None:
            raise ValueError(f"[{i}]: {why}")
    return v


class AccessRule(_Section):
    """What one identity (or every identity matching a glob) may do on this GPU host. Unset
    limits fall back to the ``executor`` section."""

    max_sessions: int | None = Field(default=None, ge=1)  # open sessions at once; null: no limit
    memory_quota: int | None = None  # bytes per session; null: executor.memory_quota
    allow_extra: tuple[str, ...] = ()  # operators added to the allowlist for this identity

    @field_validator("memory_quota", mode="before")
    @classmethod
    def _size(cls, v: int | str | None) -> int | None:
        return None if v is None else parse_size(v)

    @field_validator("allow_extra", mode="before")
    @classmethod
    def _operators(cls, v: Any) -> Any:
        return _check_operators(v, extra=True)


class InterceptConfig(_Section):
    backend: str = "torch"
    mode: Literal["stream", "sync"] = "stream"  # sync: wait for every call (Cricket semantics)
    fallback: Literal["local", "error"] = "local"  # no daemon or host: run locally, or raise
    replay: bool = True  # record/replay: one request per inference once the sequence is found
    # ms from an inference's start after which its waits for the host give up and the shim
    # computes the rest here (fallback: local); None: wait as long as the host is up
    deadline_ms: float | None = Field(default=None, gt=0, le=3_600_000)


class ExecutorConfig(_Section):
    backend: str = "torch"
    device: str = "auto"  # auto: cuda when available, else cpu
    memory_quota: int = 2 * 2**30  # bytes per session
    # bytes all sessions together; None: half the device memory (GPU) or RAM (CPU host)
    memory_limit: int | None = None
    # app sessions this gpu daemon serves at once, all identities together; one more is refused
    # (RESOURCE_EXHAUSTED) when it opens. None: no limit. An access rule's max_sessions limits
    # one identity on top of this.
    max_sessions: int | None = Field(default=None, ge=1)
    # Operators added to the built-in positive allowlist; internal or unsafe ones only when
    # written as "unsafe:ns::op" (rrtod/opnames.py, docs/allowlist.md).
    allow_extra: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()  # operators removed from it

    @field_validator("memory_quota", mode="before")
    @classmethod
    def _size(cls, v: int | str) -> int:
        return parse_size(v)

    @field_validator("memory_limit", mode="before")
    @classmethod
    def _limit(cls, v: int | str | None) -> int | None:
        return None if v is None else parse_size(v)

    @field_validator("max_sessions", mode="before")
    @classmethod
    def _count(cls, v: Any) -> Any:
        if isinstance(v, bool):  # YAML "yes"/"true" is an int subclass: not a count
            raise ValueError(f"expected a number of sessions (at least 1) or null, got {v!r}")
        return v

    @field_validator("allow_extra", "deny", mode="before")
    @classmethod
    def _operators(cls, v: Any, info: ValidationInfo) -> Any:
        return _check_operators(v, extra=info.field_name == "allow_extra")


class WeightCacheConfig(_Section):
    max_bytes: int = 8 * 2**30
    # false: an entry is visible only to the identities that uploaded it; true: to every robot.
    shared: bool = False

    @field_validator("max_bytes", mode="before")
    @classmethod
    def _size(cls, v: int | str) -> int:
        return parse_size(v)


class SocketLimitsConfig(_Section):
    """Limits of the app/rrtoctl unix socket, so that local clients cannot exhaust the daemon's
    memory or descriptors (docs/security.md)."""

    max_connections: int = Field(default=1024, ge=2)  # connections served at once
    hello_timeout: float = Field(default=10.0, gt=0)  # seconds a connection may idle before hello
    max_control_frame: int = 64 * 2**10  # largest frame before hello (AppHello, CtlRequest)
    max_frame: int = 2**30  # largest frame of an app session: what one connection may buffer
    max_buffered: int = 2 * 2**30  # large frames all connections may buffer together
    # per app session, a shared memory region for its large replayed inputs (a memfd, its
    # pages made as the app writes them: rrtod.shared_uploads); 0: none, all on the socket.
    # Left unset, at most max_frame (``shared_bytes``).
    shared_upload: int = 64 * 2**20

    @property
    def shared_bytes(self) -> int:
        """The region's size an app session gets."""
        return min(self.shared_upload, self.max_frame)

    @field_validator("max_control_frame", "max_frame", "max_buffered", "shared_upload",
                     mode="before")
    @classmethod
    def _size(cls, v: int | str) -> int:
        return parse_size(v)

    @model_validator(mode="after")
    def _ordered(self) -> SocketLimitsConfig:
        if not 1024 <= self.max_control_frame <= self.max_frame:
            raise ValueError("max_control_frame: must be between 1KiB and max_frame")
        if self.max_frame > MAX_FRAME:
            raise ValueError(f"max_frame: at most {MAX_FRAME} bytes (1GiB)")
        if self.max_buffered < self.max_frame:
            raise ValueError("max_buffered: must be at least max_frame")
        if self.shared_upload < 0 or ("shared_upload" in self.model_fields_set
                                      and self.shared_upload > self.max_frame):
            raise ValueError("shared_upload: must be between 0 and max_frame")
        return self


class HealthConfig(_Section):
    interval: float = Field(default=1.0, gt=0, le=60)  # seconds between pings to each host
    timeout: float = Field(default=1.0, gt=0, le=60)  # a ping slower than this counts as lost
    down_after: int = Field(default=2, ge=1)  # consecutive lost pings before a host is down


class RecordConfig(_Section):
    """robot role: how long an app waits for the sequence search of its first inferences, so
    that the sequence found replays its next inference rather than a later one."""

    search_wait: float = Field(default=0.1, ge=0, le=10)  # one inference start, at most (s)
    hint_budget: float = Field(default=0.2, ge=0, le=60)  # all such waits of a session's log (s)


class PowerConfig(_Section):
    meter: str = "auto"
    sample_hz: float = Field(default=10.0, gt=0, le=1000)
    model: dict[str, float] = Field(
        default_factory=lambda: {"inference": 13.35, "communication": 4.25, "standby": 4.04}
    )


class LogConfig(_Section):
    format: Literal["auto", "json", "console"] = "auto"  # auto: console on a TTY, else JSON
    level: Literal["debug", "info", "warning", "error"] = "info"


class MetricsConfig(_Section):
    listen: str | None = "127.0.0.1:9730"  # null disables the Prometheus endpoint

    @field_validator("listen")
    @classmethod
    def _addr(cls, v: str | None) -> str | None:
        return None if v is None else _check_address(v)


class Config(_Section):
    """The whole daemon configuration. Defaults make a single-machine daemon holding both roles."""

    roles: tuple[Role, ...] = ("robot", "gpu")
    node: str = Field(default_factory=socket.gethostname)
    socket: str = "/run/rrto/rrtod.sock"
    socket_mode: int = 0o660
    socket_limits: SocketLimitsConfig = SocketLimitsConfig()
    state_dir: str = "/var/lib/rrto"
    listen: str | None = None  # gpu role: a TCP address too; null: only the unix peer socket
    # gpu role: a plaintext TCP address serving only the standard gRPC health service (probes)
    health_listen: str | None = None
    hosts: tuple[HostConfig, ...] = ()
    tls: TLSConfig = TLSConfig()
    access: dict[str, AccessRule] = Field(default_factory=dict)  # gpu role: identity -> rule
    intercept: InterceptConfig = InterceptConfig()
    executor: ExecutorConfig = ExecutorConfig()
    weight_cache: WeightCacheConfig = WeightCacheConfig()
    health: HealthConfig = HealthConfig()
    search: str = "dds"
    record: RecordConfig = RecordConfig()
    scheduler: str = "remote-all"
    # robot role, with a scheduler that splits: a placement per bandwidth band of the link, the
    # plan switched per inference as the link changes band (docs/scheduling.md). Off by
    # default: the link is read from each replay's data as it lands on the host, and a robot
    # whose CPU is the bottleneck (a quarter of a CPU here) paces that data, not the link.
    switch_plans: bool = False
    balancer: str = "least-loaded"
    # robot role: "inference" places each replayed inference of a stateless sequence on the
    # host the balancer picks (placement.py); "session" keeps a session's work on one host
    placement: Literal["inference", "session"] = "inference"
    # Per balancer plugin, its options: {name: {option: value}}. The block of the balancer
    # chosen above goes to its factory, which validates it (rrtod.robot.balancing).
    balancers: dict[str, dict[str, Any]] = Field(default_factory=dict)
    power: PowerConfig = PowerConfig()
    log: LogConfig = LogConfig()
    metrics: MetricsConfig = MetricsConfig()
    drain_timeout: float = Field(default=10.0, ge=0)  # SIGTERM: seconds to let sessions finish

    @field_validator("roles")
    @classmethod
    def _roles(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("at least one role is required")
        if len(set(v)) != len(v):
            raise ValueError("roles must not repeat")
        return v

    @field_validator("listen", "health_listen")
    @classmethod
    def _listen(cls, v: str | None) -> str | None:
        return None if v is None else _check_address(v)

    @field_validator("access")
    @classmethod
    def _access(cls, v: dict[str, AccessRule]) -> dict[str, AccessRule]:
        for name in v:
            if not name.strip():
                raise ValueError("identity names must not be empty")
        return v

    @field_validator("balancers")
    @classmethod
    def _balancers(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for name in v:
            if not name.strip():
                raise ValueError("balancer names must not be empty")
        return v

    @field_validator("socket_mode", mode="before")
    @classmethod
    def _mode(cls, v: Any) -> int:
        if isinstance(v, str):
            try:
                v = int(v, 8)
            except ValueError:
                raise ValueError(f"expected an octal file mode such as 0660, got {v!r}") from None
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 0o777:
            raise ValueError("expected an octal file mode such as 0660")
        return v

    @model_validator(mode="after")
    def _hosts_unique(self) -> Config:
        names = [h.name for h in self.hosts]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"hosts: duplicate host name(s) {', '.join(dupes)}")
        return self

    @model_validator(mode="after")
    def _health_port(self) -> Config:
        if self.health_listen is not None and self.health_listen == self.listen:
            raise ValueError("health_listen: must differ from listen (it serves plaintext)")
        return self

    @model_validator(mode="after")
    def _tls_for_tcp(self) -> Config:
        """Certificates are required where a TCP peer link uses them, and only there."""
        tcp = ("gpu" in self.roles and self.listen is not None) or (
            "robot" in self.roles and any(not is_unix(h.address) for h in self.peer_hosts()))
        problem = self.tls.missing() if tcp else None
        if problem:
            raise ValueError(f"{problem} (the peer link uses TCP)")
        return self

    @property
    def peer_socket(self) -> str:
        """The gpu role's unix peer socket: beside the app socket, with its file mode."""
        return str(Path(self.socket).parent / "peer.sock")

    def peer_hosts(self) -> tuple[HostConfig, ...]:
        """Hosts a robot daemon connects to. A daemon that also holds the gpu role and names no
        host offloads to itself (the single-machine default) over its unix peer socket,
        through the same gRPC path as a remote host: no TCP port, no certificate."""
        if self.hosts or "gpu" not in self.roles:
            return self.hosts
        return (HostConfig(name="local", address=f"unix:{self.peer_socket}"),)

    def plugin_choices(self) -> list[tuple[str, str, str]]:
        """(config key, plugin family, name) for every plugin this config selects, so the daemon
        can fail at start, naming the key, rather than at the first session."""
        out = [("intercept.backend", "interception", self.intercept.backend)]
        if "gpu" in self.roles:
            out.append(("executor.backend", "interception", self.executor.backend))
        if "robot" in self.roles:
            out.append(("balancer", "balancer", self.balancer))
            out.append(("scheduler", "scheduler", self.scheduler))
            out.append(("search", "search", self.search))
            out += [(f"hosts[{i}].transport", "transport", h.transport)
                    for i, h in enumerate(self.peer_hosts())]
            if self.power.meter != "auto":  # "a+b" sums several meters
                out += [("power.meter", "power", n.strip()) for n in self.power.meter.split("+")]
        return out

    def describe(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class LoadedConfig:
    """A validated Config plus where it came from (for status, reload and errors found after
    validation, such as a plugin's options: ``file_of``)."""

    def __init__(self, config: Config, files: list[Path], origin: dict[str, str] | None = None):
        self.config = config
        self.files = files
        self.origin = origin or {}  # dotted key -> the file that set it

    @property
    def path(self) -> Path | None:
        return self.files[0] if self.files else None

    def file_of(self, key: str) -> str:
        """The file that set ``key`` (or the nearest key above it), else the main file."""
        if self.origin:
            return _origin_of(key, self.origin, self.files)
        return str(self.path) if self.path else "<defaults>"


def resolve_path(explicit: str | os.PathLike[str] | None = None) -> Path:
    if explicit:
        return Path(explicit)
    if os.environ.get(ENV_PATH):
        return Path(os.environ[ENV_PATH])
    return DEFAULT_PATH


def config_files(main: Path) -> list[Path]:
    """The main file, then ``rrtod.d/*.yaml`` beside it, in name order."""
    drop_in = main.parent / (main.stem + ".d")
    extra = sorted(drop_in.glob("*.yaml")) if drop_in.is_dir() else []
    return [main, *extra]


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(str(path), "", "file not found") from None
    except OSError as exc:
        raise ConfigError(str(path), "", f"cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:  # load() promises ConfigError only, even for binary junk
        raise ConfigError(str(path), "", f"not UTF-8 text (byte {exc.start})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(str(path), "", f"invalid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise ConfigError(str(path), "", f"expected a mapping at top level, got {kind}")
    return data


def _merge(
    base: dict[str, Any],
    over: Mapping[str, Any],
    origin: dict[str, str],
    file: str,
    prefix: str = "",
) -> None:
    """Merge ``over`` into ``base`` in place, recording which file set each key path."""
    for key, value in over.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value, origin, file, path + ".")
        else:
            base[key] = dict(value) if isinstance(value, Mapping) else value
            # The old value's sub-keys are gone: forget which files set them, so an error
            # inside the new value is blamed on this file.
            for stale in [k for k in origin if k.startswith((path + ".", path + "["))]:
                del origin[stale]
            origin[path] = file
        origin.setdefault(path, file)


def _error_key(loc: tuple[Any, ...]) -> str:
    key = ""
    for part in loc:
        if isinstance(part, int):
            key += f"[{part}]"
        elif str(part).startswith("function-") or part in ("function-after", "function-before"):
            continue
        else:
            key += f".{part}" if key else str(part)
    return key


def _origin_of(key: str, origin: dict[str, str], files: list[Path]) -> str:
    probe = key
    while probe:
        bare = probe.split("[")[0]
        if bare in origin:
            return origin[bare]
        probe = probe.rpartition(".")[0]
    return str(files[-1]) if files else "<defaults>"


def explain(exc: ValidationError) -> tuple[str, str]:
    """(dotted key, reason) of a pydantic error, phrased for an operator. Also used for models
    validated after the config (a balancer's options: ``rrtod.robot.balancing``)."""
    err = exc.errors()[0]
    key = _error_key(err["loc"])
    reason = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        reason = "unknown key"
    elif err["type"] in ("tuple_type", "list_type"):
        reason = f"expected a list, got {type(err.get('input')).__name__}"
    elif err["type"] in ("model_type", "dict_type"):
        reason = f"expected a mapping, got {type(err.get('input')).__name__}"
    elif err["type"] == "literal_error":
        reason = f"{reason}, got {err.get('input')!r}"
    # Model-level checks phrase their own key ("ca: required ..."): fold it into the path.
    head, sep, tail = reason.partition(": ")
    if sep and head.startswith("[") and head.endswith("]") and head[1:-1].isdigit():
        key, reason = key + head, tail  # a list item's own check: "[2]: why"
    elif sep and head.replace("_", "").replace(".", "").isalnum():
        key, reason = (f"{key}.{head}" if key else head), tail
    return key, reason


def validate(data: dict[str, Any], origin: dict[str, str], files: list[Path]) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        key, reason = explain(exc)
        raise ConfigError(_origin_of(key, origin, files), key, reason) from None


def load(path: str | os.PathLike[str] | None = None) -> LoadedConfig:
    """Read, merge and validate the configuration. Raises ConfigError, never anything else."""
    main = resolve_path(path)
    files = config_files(main)
    data: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for file in files:
        _merge(data, _read_yaml(file), origin, str(file))
    return LoadedConfig(validate(data, origin, files), files, origin)


def find_socket(path: str | os.PathLike[str] | None = None) -> str:
    """The daemon's socket path as rrtoctl and the shim need it: only the ``socket`` key is read,
    so a config broken elsewhere (the operator is mid-edit) still leads to the running daemon."""
    socket_path = Config.model_fields["socket"].default
    main = resolve_path(path)
    if not main.exists() and path is None:
        return socket_path
    for file in config_files(main):
        value = _read_yaml(file).get("socket")
        if isinstance(value, str) and value:
            socket_path = value
    return socket_path


def from_mapping(data: Mapping[str, Any], name: str = "<inline>") -> Config:
    """Validate a mapping (tests, embedding) with the same error wording as files."""
    origin: dict[str, str] = {}
    merged: dict[str, Any] = {}
    _merge(merged, data, origin, name)
    return validate(merged, origin, [Path(name)])
