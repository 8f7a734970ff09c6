"""``rrtoctl``: talk to the local rrtod over its unix socket.

It finds the socket from the same configuration the daemon reads (``--config``, ``RRTO_CONFIG``,
``/etc/rrto/rrtod.yaml``), or ``--socket``. Every command takes ``--json`` for scripts. When the
daemon cannot be reached the error is one line naming the socket, exit status 2, no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from rrto.v1 import local_pb2
from rrtod import config as config_mod
from rrtod.framing import FramedSocket

EXIT_UNREACHABLE = 2
EXIT_FAILED = 1


class CtlError(Exception):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def request(socket_path: str, command: str, args: dict[str, str] | None = None,
            timeout: float = 10.0) -> Any:
    """Send one control command and return its decoded JSON result."""
    try:
        conn = FramedSocket(socket_path, timeout=timeout)
    except OSError as exc:
        raise CtlError(f"cannot reach rrtod at {socket_path}: {exc.strerror or exc}",
                       EXIT_UNREACHABLE) from None
    try:
        with conn:
            conn.send(local_pb2.LocalRequest(ctl=local_pb2.CtlRequest(command=command,
                                                                      args=args or {})))
            reply = conn.recv(local_pb2.LocalReply)
    except (OSError, ConnectionError) as exc:
        raise CtlError(f"rrtod at {socket_path} did not answer: {exc}", EXIT_UNREACHABLE) from None
    if reply.WhichOneof("msg") == "error":
        raise CtlError(f"rrtod: {reply.error.code}: {reply.error.message}", EXIT_FAILED)
    if not reply.ctl.ok:
        raise CtlError(f"rrtod: {reply.ctl.error}", EXIT_FAILED)
    return json.loads(reply.ctl.json)


def _ago(ts: float | None) -> str:
    if not ts:
        return "-"
    s = max(0.0, time.time() - ts)
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.1f}h"


def _table(rows: list[list[str]]) -> str:
    if not rows:
        return ""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


def _frameworks(app: dict[str, str] | None, host: dict[str, str] | None) -> str:
    """A session's framework versions, app then host: ``torch 2.13.0`` when both ends run
    the same, ``torch 2.13.0 / 2.14.1`` when they differ (operators whose schemas differ then
    run in the app)."""
    app, host = app or {}, host or {}
    out = []
    for name in sorted(k for k in app.keys() | host.keys() if k != "rrtod"):
        a, h = app.get(name, "?"), host.get(name, "?")
        out.append(f"{name} {a}" if a == h else f"{name} {a} / {h}")
    return ", ".join(out) or "-"


def render_status(s: dict[str, Any]) -> str:
    lines = [
        f"rrtod {s['version']} on {s['node']}  roles: {', '.join(s['roles'])}  "
        f"pid {s['pid']}  up {s['uptime_s']:.0f}s",
        f"config: {', '.join(s['config']['files'])}",
        f"socket: {s['socket']}",
        "plugins: " + "; ".join(f"{fam}: {', '.join(names) or '-'}"
                                for fam, names in s["plugins"].items()),
    ]
    resolved = [x for x in s.get("host_sources") or [] if "resolved_at" in x]  # dns: entries
    if s.get("hosts") or resolved:
        lines += ["", "HOSTS"]
    if s.get("hosts"):
        rows = [["NAME", "ADDRESS", "STATE", "SINCE", "RTT", "DEVICE", "SESSIONS"]]
        for h in s["hosts"]:
            rtt = "-" if h["rtt_ms"] is None else f"{h['rtt_ms']:.2f} ms"
            rows.append([h["name"], h["address"], h["state"], _ago(h["since"]), rtt,
                         h["device"] or "-", str(h["sessions"])])
        lines.append(_table(rows))
    for x in resolved:
        last = f"last {_ago(x['resolved_at'])} ago" if x["resolved_at"] else "never resolved"
        error = f"  error: {x['error']}" if x["error"] else ""
        lines.append(f"{x['name']}: {x['address']} resolves to {len(x['hosts'])} host(s), "
                     f"every {x['refresh']:g}s, {last}{error}")
    if s.get("sessions"):
        lines += ["", "APP SESSIONS"]
        rows = [["ID", "APP", "PID", "HOST", "STATE", "OPS", "INFERENCES", "UP", "DOWN",
                 "APP / HOST"]]
        for x in s["sessions"]:
            rows.append([x["id"], x["app"], str(x["pid"]), x["host"], x["state"],
                         str(x["ops_forwarded"]), str(x["inferences"]),
                         f"{x['bytes_up'] / 1e6:.2f} MB", f"{x['bytes_down'] / 1e6:.2f} MB",
                         _frameworks(x.get("versions"), x.get("host_versions"))])
        lines.append(_table(rows))
    gpu = s.get("gpu")
    if gpu:
        tcp = f"listen {gpu['listen']}  tls {gpu['tls']}" if gpu.get("listen") else "no TCP port"
        limit = gpu.get("max_sessions")
        refused = sum((gpu.get("refused_sessions") or {}).values())
        lines += ["", f"GPU ROLE  peer unix:{gpu.get('peer_socket')}  {tcp}  "
                      f"device {gpu['device']}",
                  f"sessions {len(gpu['sessions'])} of "
                  f"{'no limit' if limit is None else f'max {limit}'}"
                  + (f"  refused {refused}" if refused else "")]
        if gpu["sessions"]:
            rows = [["ID", "APP", "PID", "IDENTITY", "ROBOT", "OPS", "LIVE", "APP / HOST"]]
            for x in gpu["sessions"]:
                rows.append([x["id"], x["app"], str(x["pid"]), x.get("identity", "-"), x["robot"],
                             str(x.get("ops", "-")), f"{x.get('bytes_live', 0) / 1e6:.2f} MB",
                             _frameworks(x.get("app_versions"), x.get("host_versions"))])
            lines.append(_table(rows))
    power = s.get("power")
    if power:
        lines += ["", f"POWER  meter {power.get('meter')}"]
    return "\n".join(lines)


def render_plugins(p: dict[str, Any]) -> str:
    rows = [["FAMILY", "NAME", "DISTRIBUTION", "VERSION", "DESCRIPTION"]]
    for fam, items in p["families"].items():
        for it in items:
            rows.append([fam, it["name"], it["distribution"], it["version"], it["description"]])
    out = _table(rows)
    for f in p.get("failed", []):
        out += f"\nFAILED {f['entry_point']} ({f['distribution']}): {f['error']}"
    if p.get("blocked"):
        out += f"\nblocked by RRTO_DISABLE_PLUGINS: {', '.join(p['blocked'])}"
    return out


def render_sequences(p: dict[str, Any]) -> str:
    seqs = p["sequences"]
    if not seqs:
        return "no sequences recorded"
    keys = ["id", "app", "session", "operators", "loops", "inputs", "outputs", "replays",
            "mismatches", "found_at"]
    rows = [[*(k.upper() for k in keys), "HOSTS"]]
    pinned = []
    for s in seqs:
        hosts = ",".join(s["hosts"]) if s.get("hosts") else "-"
        if s.get("pinned"):
            hosts += " (pinned)"
            pinned.append(f"{s['id']}: pinned to {s['hosts'][0]}: {s['pinned']}")
        rows.append([*(str(s.get(k, "-")) for k in keys), hosts])
    return "\n".join([_table(rows), *pinned])


def operator_listing(config_path: str | None) -> dict[str, Any]:
    """This host's operator allowlist, read locally (no daemon needed): the built-in positive
    list with each entry's reason class, and the config's additions and removals."""
    from rrtod.hookspecs import InterceptionBackend
    from rrtod.plugins import discover

    ex = config_mod.load(config_path).config.executor
    record = discover().get("interception", ex.backend)
    # the backend's own list (imports torch: only here)
    listed = (record.operators() if isinstance(record, InterceptionBackend) and record.operators
              else [])
    return {"builtin": [vars(e) for e in listed],
            "allow_extra": list(ex.allow_extra), "deny": list(ex.deny)}


def render_operators(p: dict[str, Any]) -> str:
    rows = [["OPERATOR", "CLASS", "GRAD MODES", "SEEN IN"]]
    rows += [[e["name"], e["reason"], e["modes"], e["seen_in"]] for e in p["builtin"]]
    lines = [_table(rows), "", f"{len(p['builtin'])} built-in operators"]
    lines.append(f"allow_extra: {', '.join(p['allow_extra']) or '-'}")
    lines.append(f"deny: {', '.join(p['deny']) or '-'}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rrtoctl", description="control the local rrtod")
    p.add_argument("--config", help="config file the daemon uses (to find its socket)")
    p.add_argument("--socket", help="daemon socket (overrides the config)")
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (("status", "daemon, hosts, sessions"), ("plugins", "loaded plugins"),
                       ("sequences", "recorded inference sequences"),
                       ("reload", "reload the configuration (as SIGHUP)")):
        sp = sub.add_parser(name, help=text)
        sp.add_argument("--json", action="store_true", help="machine-readable output")
    op = sub.add_parser("ops", help="the operator allowlist of this host (read locally)")
    op.add_argument("--json", action="store_true", help="machine-readable output")
    fl = sub.add_parser("flush", help="drop recorded sequences")
    fl.add_argument("--json", action="store_true")
    who = fl.add_mutually_exclusive_group(required=True)
    who.add_argument("--app", help="only this app's sequences")
    who.add_argument("--all", action="store_true", help="every app's sequences")
    return p


def socket_path(args: argparse.Namespace) -> str:
    if args.socket:
        return args.socket
    return config_mod.find_socket(args.config)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "ops":
        try:
            listing = operator_listing(args.config)
        except config_mod.ConfigError as exc:
            print(f"rrtoctl: configuration error: {exc}", file=sys.stderr)
            return EXIT_FAILED
        print(json.dumps(listing, indent=2) if args.json else render_operators(listing))
        return 0
    try:
        sock = socket_path(args)
    except config_mod.ConfigError as exc:
        print(f"rrtoctl: configuration error: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    extra: dict[str, str] = {}
    if args.command == "flush":
        extra = {"all": "1"} if args.all else {"app": args.app}
    try:
        result = request(sock, args.command, extra)
    except CtlError as exc:
        print(f"rrtoctl: {exc}", file=sys.stderr)
        return exc.code
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    elif args.command == "status":
        print(render_status(result))
    elif args.command == "plugins":
        print(render_plugins(result))
    elif args.command == "sequences":
        print(render_sequences(result))
    elif args.command == "flush":
        print(f"flushed {result['flushed']} sequence(s)")
    else:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
