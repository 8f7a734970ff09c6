"""``rrto-run``: start a program with PyTorch offloading on, no source change.

    rrto-run [--sync|--stream] [--fallback local|error] [--socket PATH] -- python app.py ...
    rrto-run --install-hook     # RRTO_OFFLOAD=1 then works without rrto-run (site-packages .pth)
    rrto-run --uninstall-hook

It sets ``RRTO_OFFLOAD=1``, puts a generated ``sitecustomize`` first on ``PYTHONPATH`` (chaining
to the app's own) and replaces itself with the command. ``RRTO_OFFLOAD=0`` already in the
environment wins: the command runs locally, after one warning line.
"""

from __future__ import annotations

import argparse
import os
import sys

from rrtod.shim import site
from rrtod.switches import SwitchError, flag


def build_env(env: dict[str, str], args: argparse.Namespace) -> dict[str, str]:
    env = dict(env)
    env["RRTO_OFFLOAD"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site.site_dir()),
                                                      env.get("PYTHONPATH")]))
    if args.mode:
        env["RRTO_MODE"] = args.mode
    if args.fallback:
        env["RRTO_FALLBACK"] = args.fallback
    if args.socket:
        env["RRTO_SOCKET"] = args.socket
    return env


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rrto-run", description="Run a program with its PyTorch inference offloaded.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--sync", dest="mode", action="store_const", const="sync",
                      help="wait for the host's acknowledgement of every operator (baseline)")
    mode.add_argument("--stream", dest="mode", action="store_const", const="stream",
                      help="stream operators, block only on downloads (default)")
    p.add_argument("--fallback", choices=("local", "error"),
                   help="no daemon or host: run locally (default) or fail")
    p.add_argument("--socket", help="the robot daemon's socket (default: from the config)")
    p.add_argument("--install-hook", action="store_true",
                   help=f"install {site.PTH_NAME} so that RRTO_OFFLOAD=1 alone activates offloading")
    p.add_argument("--uninstall-hook", action="store_true", help=f"remove {site.PTH_NAME}")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.install_hook:
        print(f"installed {site.install_pth()}")
        return 0
    if args.uninstall_hook:
        print("removed" if site.uninstall_pth() else "not installed", site.pth_path())
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser().error("no command given")
    try:
        offload = flag("RRTO_OFFLOAD", True)
    except SwitchError as exc:
        print(f"rrto-run: {exc}", file=sys.stderr)
        return 2
    if not offload:
        print(f"rrto: warning: RRTO_OFFLOAD={os.environ['RRTO_OFFLOAD']}: offloading disabled, "
              "running locally", file=sys.stderr, flush=True)
        env = dict(os.environ)
    else:
        env = build_env(dict(os.environ), args)
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:
        print(f"rrto-run: cannot run {command[0]}: {exc.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
