"""How operator schemas differ between two torch builds: what ``SCHEMA_MISMATCH`` would refuse
for an app on one and a host on the other (docs/offloading.md, Versions).

    .venv/bin/python -m bench.schemas dump /tmp/a.json          # this interpreter's torch
    .venv-compat/bin/python -m bench.schemas dump /tmp/b.json  # another one
    python -m bench.schemas compare /tmp/a.json /tmp/b.json      # differing, and allowlisted

A schema is ``str(op._schema)`` of every registered operator overload, as the client hashes it
(plugins/torch/schemas.py). Needs only torch for ``dump`` and nothing for ``compare``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

LIST = Path(__file__).resolve().parent.parent / "plugins" / "torch" / "allowlist_ops.txt"


def dump(path: Path) -> None:
    import torch

    schemas = {f"{s.name}.{s.overload_name or 'default'}": str(s)
               for s in torch._C._jit_get_all_schemas()}
    path.write_text(json.dumps({"torch": torch.__version__, "schemas": schemas}))
    print(f"torch {torch.__version__}: {len(schemas)} operator overloads -> {path}")


def compare(a_path: Path, b_path: Path) -> None:
    a, b = json.loads(a_path.read_text()), json.loads(b_path.read_text())
    sa, sb = a["schemas"], b["schemas"]
    common = sa.keys() & sb.keys()
    differ = sorted(n for n in common if sa[n] != sb[n])
    allowed = {line.split()[0] for line in LIST.read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    print(f"torch {a['torch']} vs {b['torch']}: {len(common)} overloads in both, "
          f"{len(differ)} with different schemas, {len(sa.keys() - sb.keys())} only in the "
          f"first, {len(sb.keys() - sa.keys())} only in the second")
    for n in differ:
        mark = "  (allowlisted)" if n in allowed else ""
        print(f"- {n}{mark}\n    {a['torch']}: {sa[n]}\n    {b['torch']}: {sb[n]}")
    print(f"allowlisted with different schemas: {sorted(allowed & set(differ)) or 'none'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("dump").add_argument("out", type=Path)
    cmp = sub.add_parser("compare")
    cmp.add_argument("a", type=Path)
    cmp.add_argument("b", type=Path)
    args = parser.parse_args(argv)
    if args.cmd == "dump":
        dump(args.out)
    else:
        compare(args.a, args.b)
    return 0


if __name__ == "__main__":
    sys.exit(main())
