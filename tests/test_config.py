"""Configuration files: the shipped ones stay complete and valid, merging follows the documented
order, and every error tells the operator the file, the dotted key and the reason."""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from rrtod import config as cfg
from rrtod.config import Config, ConfigError, from_mapping, load

ROOT = Path(__file__).resolve().parent.parent
ETC = ROOT / "etc" / "rrto"
MAIN = ETC / "rrtod.yaml"
EXAMPLES = ETC / "examples"


# --- the shipped files ------------------------------------------------------------------------


def _submodel(annotation: Any) -> tuple[type[BaseModel], bool] | None:
    """The model class inside a field's annotation, and whether it is a list of them."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    origin = typing.get_origin(annotation)
    if origin in (tuple, list):
        args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        if args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
            return args[0], True
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _submodel(arg)
            if found:
                return found
    return None


def _field_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every field of ``model``, recursively, as dotted paths; list items as ``name[]``."""
    out = []
    for name, info in model.model_fields.items():
        out.append(prefix + name)
        found = _submodel(info.annotation)
        if found:
            sub, is_list = found
            out += _field_paths(sub, f"{prefix}{name}{'[]' if is_list else ''}.")
    return out


def _lookup(data: Any, path: str) -> tuple[bool, Any]:
    node = data
    for part in path.split("."):
        if part.endswith("[]") or not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def test_every_config_field_is_documented_in_rrtod_yaml() -> None:
    """Docs cannot drift: a new Config field fails here until rrtod.yaml documents it. A key is
    either set (to its default, checked below) or, where it has no static default (node) or is an
    item of an empty list (hosts), shown in a commented-out example line."""
    text = MAIN.read_text()
    data = yaml.safe_load(text)
    paths = _field_paths(Config)
    assert {"tls.server_name", "hosts[].address", "power.model", "drain_timeout"} <= set(paths)
    missing = []
    for path in paths:
        present, _ = _lookup(data, path)
        leaf = path.rsplit(".", 1)[-1].removesuffix("[]")
        commented = re.search(rf"^\s*#\s*(-\s+)?{re.escape(leaf)}:", text, flags=re.M)
        if not present and not commented:
            missing.append(path)
    assert missing == [], f"undocumented in {MAIN}: {missing}"


def _key_lines(text: str) -> list[tuple[str, int]]:
    """(dotted path, line index) of every active mapping key, from indentation."""
    stack: list[tuple[int, str]] = []
    out = []
    for i, line in enumerate(text.splitlines()):
        m = re.match(r"^(\s*)([A-Za-z_][A-Za-z0-9_]*):", line)
        if not m:
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, m.group(2)))
        out.append((".".join(k for _, k in stack), i))
    return out


def test_every_leaf_key_has_a_comment() -> None:
    text = MAIN.read_text()
    lines = text.splitlines()
    data = yaml.safe_load(text)
    uncommented = []
    for path, i in _key_lines(text):
        _, value = _lookup(data, path)
        if isinstance(value, dict) and path != "power.model":
            continue  # a section header; its keys carry the comments
        if path.startswith("power.model."):
            continue  # documented together, on power.model
        if "#" not in lines[i] and not lines[i - 1].strip().startswith("#"):
            uncommented.append(path)
    assert uncommented == []


def test_rrtod_yaml_is_the_embedded_default() -> None:
    loaded = load(MAIN)
    assert loaded.files == [MAIN]  # etc/rrto/rrtod.d holds no *.yaml, only its README
    assert loaded.config == Config()
    assert loaded.config.roles == ("robot", "gpu")
    assert loaded.config.tls.mode == "mtls"


def test_shipped_default_opens_no_tcp_port() -> None:
    """Finding 2 of issue 10: the single-machine default served plaintext TCP on loopback."""
    c = load(MAIN).config
    assert c.listen is None
    assert [h.address for h in c.peer_hosts()] == ["unix:/run/rrto/peer.sock"]
    assert c.peer_socket == "/run/rrto/peer.sock"  # beside the app socket, with its mode
    assert re.search(r"insecure: plaintext.*written out.*warning", MAIN.read_text(),
                     flags=re.S | re.I)


def test_tcp_needs_certificates_unless_insecure_is_written() -> None:
    with pytest.raises(ConfigError) as err:
        from_mapping({"listen": "127.0.0.1:7730"})
    assert (err.value.key, err.value.reason) == (
        "tls.ca", "required when tls.mode is 'mtls' (the peer link uses TCP)")
    with pytest.raises(ConfigError) as err:
        from_mapping({"roles": ["robot"], "hosts": [{"name": "a", "address": "a:1"}]})
    assert err.value.key == "tls.ca"
    assert from_mapping({"listen": "127.0.0.1:7730", "tls": {"mode": "insecure"}}).listen
    unix = from_mapping({"roles": ["robot"], "hosts": [{"name": "a", "address": "unix:/r/p.sock"}]})
    assert unix.tls.mode == "mtls" and unix.peer_hosts()[0].address == "unix:/r/p.sock"


def test_record_waits_validate() -> None:
    c = from_mapping({"record": {"search_wait": 0.5}})
    assert (c.record.search_wait, c.record.hint_budget) == (0.5, 0.2)
    with pytest.raises(ConfigError) as err:
        from_mapping({"record": {"search_wait": 11}})
    assert err.value.key == "record.search_wait" and "10" in err.value.reason
    with pytest.raises(ConfigError) as err:
        from_mapping({"record": {"hint_budget": -1}})
    assert err.value.key == "record.hint_budget"


def test_dns_hosts_entry() -> None:
    """A pool behind one name: TCP (so certificates are required), refreshed every 10 s."""
    entry = {"name": "gpu-pool", "address": "dns:///rrto-gpu.rrto.svc.cluster.local:7730"}
    with pytest.raises(ConfigError) as err:
        from_mapping({"roles": ["robot"], "hosts": [entry]})
    assert err.value.key == "tls.ca"
    c = from_mapping({"roles": ["robot"], "hosts": [entry], "tls": {"mode": "insecure"}})
    assert c.hosts[0].refresh == 10.0 and cfg.is_dns(c.hosts[0].address)
    assert ("hosts[0].transport", "transport", "grpc") in c.plugin_choices()


def test_access_rules_validate() -> None:
    c = from_mapping({"access": {"spiffe://fleet/robot-1": {"max_sessions": 2,
                                                           "memory_quota": "1GiB"},
                                 "spiffe://fleet/*": {"allow_extra": ["aten::x"]}}})
    rule = c.access["spiffe://fleet/robot-1"]
    assert (rule.max_sessions, rule.memory_quota) == (2, 2**30)
    assert c.access["spiffe://fleet/*"].allow_extra == ("aten::x",)


def _with_real_cert_paths(src: Path, dst_dir: Path) -> Path:
    """Copy ``src`` into ``dst_dir`` with /etc/rrto/tls/* pointing at files that exist."""
    tls = dst_dir / "tls"
    tls.mkdir(exist_ok=True)
    text = src.read_text()
    for name in set(re.findall(r"/etc/rrto/tls/([\w.-]+)", text)):
        (tls / name).write_text("-----BEGIN PLACEHOLDER-----\n")
    out = dst_dir / src.name.removesuffix(".example")
    out.write_text(text.replace("/etc/rrto/tls/", f"{tls}/"))
    return out


def test_robot_example_validates(tmp_path: Path) -> None:
    c = load(_with_real_cert_paths(EXAMPLES / "robot.yaml", tmp_path)).config
    assert c.roles == ("robot",)
    assert [h.name for h in c.hosts] == ["edge1", "edge2"]
    assert c.tls.mode == "mtls"
    assert all(Path(p).is_file() for p in (c.tls.ca, c.tls.cert, c.tls.key))
    assert c.peer_hosts() == c.hosts


def test_gpu_example_validates(tmp_path: Path) -> None:
    c = load(_with_real_cert_paths(EXAMPLES / "gpu.yaml", tmp_path)).config
    assert c.roles == ("gpu",) and c.listen == "0.0.0.0:7730"
    assert c.tls.mode == "mtls"
    assert all(Path(p).is_file() for p in (c.tls.ca, c.tls.cert, c.tls.key))


def test_drop_in_example_applies_over_the_main_file(tmp_path: Path) -> None:
    (tmp_path / "rrtod.yaml").write_text(MAIN.read_text())
    (tmp_path / "rrtod.d").mkdir()
    (tmp_path / "rrtod.d" / "50-local.yaml").write_text(
        (EXAMPLES / "50-local.yaml.example").read_text()
    )
    c = load(tmp_path / "rrtod.yaml").config
    assert c.executor.memory_quota == 4 * 2**30
    assert c.executor.device == "auto"  # merged, not replaced
    assert [h.name for h in c.hosts] == ["lab"]
    assert c.log.level == "debug" and c.log.format == "auto"


def test_drop_in_readme_is_ignored(tmp_path: Path) -> None:
    (tmp_path / "rrtod.yaml").write_text("roles: [gpu]\n")
    (tmp_path / "rrtod.d").mkdir()
    (tmp_path / "rrtod.d" / "README").write_text((ETC / "rrtod.d" / "README").read_text())
    assert load(tmp_path / "rrtod.yaml").files == [tmp_path / "rrtod.yaml"]


# --- merging ----------------------------------------------------------------------------------


def _tree(tmp_path: Path, main: str, **drop_ins: str) -> Path:
    path = tmp_path / "rrtod.yaml"
    path.write_text(main)
    if drop_ins:
        (tmp_path / "rrtod.d").mkdir()
        for name, text in drop_ins.items():
            (tmp_path / "rrtod.d" / name.replace("_", "-")).write_text(text)
    return path


def test_drop_ins_in_name_order_later_wins(tmp_path: Path) -> None:
    main = _tree(
        tmp_path,
        "search: a\nscheduler: a\nbalancer: a\n",
        **{"20_b.yaml": "scheduler: b\nbalancer: b\n", "10_a.yaml": "balancer: x\nsearch: x\n",
           "30_c.yaml": "balancer: c\n", "99_off.yml": "search: ignored\n"},
    )
    loaded = load(main)
    assert [p.name for p in loaded.files] == ["rrtod.yaml", "10-a.yaml", "20-b.yaml", "30-c.yaml"]
    c = loaded.config
    assert (c.search, c.scheduler, c.balancer) == ("x", "b", "c")


def test_mappings_merge_lists_replace(tmp_path: Path) -> None:
    main = _tree(
        tmp_path,
        "hosts: [{name: a, address: a:1}, {name: b, address: b:1}]\n"
        "health: {interval: 2.0, timeout: 0.5}\n"
        "executor: {allow_extra: ['aten::x', 'aten::y']}\ntls: {mode: insecure}\n",
        **{"50_x.yaml": "hosts: [{name: c, address: c:1}]\nhealth: {timeout: 3.0}\n"
                        "executor: {allow_extra: ['aten::z']}\n"},
    )
    c = load(main).config
    assert [h.name for h in c.hosts] == ["c"]
    assert (c.health.interval, c.health.timeout, c.health.down_after) == (2.0, 3.0, 2)
    assert c.executor.allow_extra == ("aten::z",)


def test_empty_drop_in_changes_nothing(tmp_path: Path) -> None:
    main = _tree(tmp_path, "roles: [gpu]\n", **{"10_empty.yaml": "# nothing yet\n"})
    assert load(main).config.roles == ("gpu",)


def test_null_disables_metrics_from_a_drop_in(tmp_path: Path) -> None:
    main = _tree(tmp_path, "metrics: {listen: '127.0.0.1:9999'}\n",
                 **{"10_x.yaml": "metrics: {listen: null}\n"})
    assert load(main).config.metrics.listen is None


# --- path resolution --------------------------------------------------------------------------


def test_explicit_path_beats_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env_file = tmp_path / "env.yaml"
    env_file.write_text("search: from-env\n")
    arg_file = tmp_path / "arg.yaml"
    arg_file.write_text("search: from-arg\n")
    monkeypatch.setenv("RRTO_CONFIG", str(env_file))
    assert load().config.search == "from-env"
    assert load(arg_file).config.search == "from-arg"
    assert load(str(arg_file)).files == [arg_file]


def test_default_path_without_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RRTO_CONFIG", raising=False)
    assert cfg.resolve_path() == Path("/etc/rrto/rrtod.yaml")
    monkeypatch.setenv("RRTO_CONFIG", "")
    assert cfg.resolve_path() == Path("/etc/rrto/rrtod.yaml")


def test_drop_in_directory_follows_the_main_file(tmp_path: Path) -> None:
    main = _tree(tmp_path, "search: a\n")
    (tmp_path / "test.yaml").write_text("search: t\n")
    (tmp_path / "test.d").mkdir()
    (tmp_path / "test.d" / "1.yaml").write_text("search: t-drop\n")
    assert load(main).config.search == "a"
    assert load(tmp_path / "test.yaml").config.search == "t-drop"


# --- errors -----------------------------------------------------------------------------------


def _error(tmp_path: Path, main: str, **drop_ins: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(_tree(tmp_path, main, **drop_ins))
    return info.value


@pytest.mark.parametrize(
    ("text", "key", "reason"),
    [
        ("bogus: 1\n", "bogus", "unknown key"),
        ("tls: {mode: insecure, keyfile: x}\n", "tls.keyfile", "unknown key"),
        ("listen: 7730\n", "listen", "valid string"),
        ("health: {interval: soon}\n", "health.interval", "valid number"),
        ("health: {interval: 0}\n", "health.interval", "greater than 0"),
        ("intercept: {deadline_ms: 0}\n", "intercept.deadline_ms", "greater than 0"),
        ("intercept: {deadline_ms: soon}\n", "intercept.deadline_ms", "valid number"),
        ("roles: robot\n", "roles", "expected a list"),
        ("roles: [robot, gpus]\n", "roles[1]", "'gpus'"),
        ("roles: []\n", "roles", "at least one role"),
        ("tls: 5\n", "tls", "expected a mapping"),
        ("listen: localhost\n", "listen", "HOST:PORT"),
        ("listen: 'h:70000'\n", "listen", "HOST:PORT"),
        ("listen: '::1:7730'\n", "listen", "brackets"),
        ("metrics: {listen: nowhere}\n", "metrics.listen", "HOST:PORT"),
        ("hosts: [{name: a, address: 'a'}]\n", "hosts[0].address", "HOST:PORT"),
        ("hosts: [{name: a}]\n", "hosts[0].address", "Field required"),
        ("hosts: [{name: a, address: 'a:1'}, {name: a, address: 'b:1'}]\n", "hosts",
         "duplicate host name(s) a"),
        ("executor: {memory_quota: lots}\n", "executor.memory_quota", "512MiB"),
        ("executor: {memory_quota: 2XB}\n", "executor.memory_quota", "512MiB"),
        ("executor: {memory_quota: yes}\n", "executor.memory_quota", "512MiB"),
        ("weight_cache: {max_bytes: -1}\n", "weight_cache.max_bytes", ">= 0"),
        ("socket_mode: rw\n", "socket_mode", "octal"),
        ("socket_mode: 01777\n", "socket_mode", "octal"),
        ("listen: '[::]:1'\ntls: {mode: mtls}\n", "tls.ca", "required when tls.mode is 'mtls'"),
        ("listen: ':1'\n", "listen", "HOST:PORT"),
        ("listen: '0.0.0.0:1'\ntls: {mode: mtls, ca: a, cert: b}\n", "tls.key", "required"),
        ("listen: '0.0.0.0:1'\ntls: {mode: tls, ca: a, cert: b}\n", "tls",
         "give both or neither"),
        ("hosts: [{name: a, address: 'unix:rel.sock'}]\n", "hosts[0].address",
         "unix:/absolute/path"),
        ("access: {'spiffe://x/r': {max_sessions: 0}}\n", "access.spiffe://x/r.max_sessions",
         "greater than or equal to 1"),
        ("access: {r1: {memory_quota: lots}}\n", "access.r1.memory_quota", "512MiB"),
        ("access: {r1: {bogus: 1}}\n", "access.r1.bogus", "unknown key"),
        ("access: [r1]\n", "access", "expected a mapping, got list"),
        ("access: {' ': {}}\n", "access", "must not be empty"),
        ("tls: {mode: plaintext}\n", "tls.mode", "'plaintext'"),
        ("log: {level: verbose}\n", "log.level", "'verbose'"),
        ("power: {model: {inference: hot}}\n", "power.model.inference", "valid number"),
        ("drain_timeout: -1\n", "drain_timeout", "greater than or equal to 0"),
        ("hosts: [{name: p, address: 'dns://10.0.0.2/pool:7730'}]\n", "hosts[0].address",
         "no DNS server can be named"),
        ("hosts: [{name: p, address: 'dns:///pool'}]\n", "hosts[0].address",
         "dns:///NAME:PORT"),
        ("hosts: [{name: p, address: 'pool:7730', refresh: 5}]\n", "hosts[0].refresh",
         "only a dns:///NAME:PORT address"),
        ("hosts: [{name: p, address: 'dns:///pool:7730', refresh: 0}]\n", "hosts[0].refresh",
         "greater than 0"),
        ("hosts: [{name: a/b, address: 'pool:7730'}]\n", "hosts[0].name", "must not contain '/'"),
        ("roles: [gpu]\nlisten: '0.0.0.0:1'\nhealth_listen: '0.0.0.0:1'\n"
         "tls: {mode: insecure}\n", "health_listen", "must differ from listen"),
        ("health_listen: 7731\n", "health_listen", "valid string"),
        ("socket_limits: {max_frame: 1MiB, max_buffered: 1MiB, shared_upload: 2MiB}\n",
         "socket_limits.shared_upload", "must be between 0 and max_frame"),
    ],
)
def test_errors_name_file_key_and_reason(tmp_path: Path, text: str, key: str, reason: str) -> None:
    err = _error(tmp_path, text)
    main = str(tmp_path / "rrtod.yaml")
    assert (err.file, err.key) == (main, key), str(err)
    assert reason in err.reason, str(err)
    assert str(err) == f"{main}: {key}: {err.reason}"


def test_error_in_a_drop_in_names_the_drop_in(tmp_path: Path) -> None:
    err = _error(tmp_path, "health: {interval: 1.0}\n",
                 **{"10_ok.yaml": "search: x\n", "20_bad.yaml": "health: {timeout: never}\n"})
    assert err.file == str(tmp_path / "rrtod.d" / "20-bad.yaml")
    assert err.key == "health.timeout"


def test_error_blame_follows_the_file_that_replaced_a_section(tmp_path: Path) -> None:
    """A section replaced wholesale (here after being nulled) is blamed on the replacing file,
    not on an earlier file that once set the same sub-key."""
    err = _error(tmp_path, "metrics: {listen: '127.0.0.1:1'}\n",
                 **{"10_a.yaml": "metrics: {listen: '127.0.0.1:2'}\n",
                    "20_b.yaml": "metrics: null\n",
                    "30_c.yaml": "metrics: {listen: bad}\n"})
    assert (Path(err.file).name, err.key) == ("30-c.yaml", "metrics.listen")


def test_unknown_key_in_a_drop_in_names_the_drop_in(tmp_path: Path) -> None:
    err = _error(tmp_path, "roles: [gpu]\n", **{"10_x.yaml": "exector: {device: cpu}\n"})
    assert (Path(err.file).name, err.key, err.reason) == ("10-x.yaml", "exector", "unknown key")


def test_invalid_yaml_reports_the_line(tmp_path: Path) -> None:
    err = _error(tmp_path, "roles: [robot, gpu]\nhosts: [{name: a\nsearch: dds\n")
    assert err.file == str(tmp_path / "rrtod.yaml") and err.key == ""
    assert "invalid YAML" in err.reason
    assert re.search(r"line \d+", err.reason)


def test_invalid_yaml_line_number_is_one_based(tmp_path: Path) -> None:
    err = _error(tmp_path, "search: dds\nlog:\n\tlevel: info\n")
    assert "line 3" in err.reason, err.reason


@pytest.mark.parametrize(("text", "kind"), [("- robot\n- gpu\n", "list"), ("just text\n", "str")])
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str, kind: str) -> None:
    err = _error(tmp_path, text)
    assert err.file == str(tmp_path / "rrtod.yaml")
    assert "mapping at top level" in err.reason and kind in err.reason


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path / "nope.yaml")
    assert info.value.file == str(tmp_path / "nope.yaml")
    assert "not found" in info.value.reason


def test_binary_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "rrtod.yaml"
    path.write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(ConfigError) as info:
        load(path)
    assert info.value.file == str(path) and "UTF-8" in info.value.reason


def test_unreadable_path_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(ConfigError) as info:
        load(tmp_path / "dir.yaml")
    assert "cannot read" in info.value.reason


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    assert load(_tree(tmp_path, "")).config == Config()


def test_socket_mode_accepts_yaml_octal_and_strings() -> None:
    assert cfg.from_mapping({"socket_mode": 0o640}).socket_mode == 0o640
    assert cfg.from_mapping({"socket_mode": "0640"}).socket_mode == 0o640
    assert yaml.safe_load("m: 0660")["m"] == 0o660  # what rrtod.yaml relies on


@pytest.mark.parametrize(
    ("text", "expected"),
    [("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("1.5G", 1_500_000_000), ("10 kb", 10_000),
     (4096, 4096), ("0", 0)],
)
def test_parse_size(text: int | str, expected: int) -> None:
    assert cfg.parse_size(text) == expected


def test_from_mapping_uses_the_same_wording() -> None:
    with pytest.raises(ConfigError) as info:
        cfg.from_mapping({"listen": "[::1]:7730", "tls": {"mode": "mtls"}}, name="inline.yaml")
    assert str(info.value) == ("inline.yaml: tls.ca: required when tls.mode is 'mtls' "
                               "(the peer link uses TCP)")
