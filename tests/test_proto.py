"""The committed generated modules of the wire contract are exactly what protoc makes of the
.proto files. A hand edit or a forgotten `make proto` would otherwise ship stubs that disagree
with the contract other implementations build from."""

from __future__ import annotations

import difflib
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTOS = sorted((PROTO_ROOT / "rrto" / "v1").glob("*.proto"))
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")

pytest.importorskip("grpc_tools", reason="grpcio-tools (the dev extra) is not installed")


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("proto")
    result = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_ROOT}", f"--python_out={out}",
         f"--pyi_out={out}", f"--grpc_python_out={out}",
         *(str(p.relative_to(PROTO_ROOT)) for p in PROTOS)],
        cwd=PROTO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return out


def test_there_are_protos() -> None:
    assert {p.stem for p in PROTOS} >= {"local", "ops", "peer"}


def test_generated_file_set_matches(regenerated: Path) -> None:
    made = {p.relative_to(regenerated) for p in regenerated.rglob("*") if p.is_file()}
    expected = {Path("rrto/v1") / f"{p.stem}{s}" for p in PROTOS for s in SUFFIXES}
    assert made == expected
    committed = {p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / "rrto" / "v1").iterdir()
                 if p.name.endswith(SUFFIXES)}
    assert committed == expected, "stale or missing generated modules under proto/rrto/v1"


@pytest.mark.parametrize("name", [f"{p.stem}{s}" for p in PROTOS for s in SUFFIXES])
def test_committed_module_is_byte_equal(regenerated: Path, name: str) -> None:
    fresh = (regenerated / "rrto" / "v1" / name).read_bytes()
    committed = (PROTO_ROOT / "rrto" / "v1" / name).read_bytes()
    if fresh != committed:
        diff = "".join(difflib.unified_diff(
            committed.decode(errors="replace").splitlines(keepends=True),
            fresh.decode(errors="replace").splitlines(keepends=True),
            f"committed/{name}", f"regenerated/{name}", n=1,
        ))
        pytest.fail(
            f"proto/rrto/v1/{name} differs from protoc output (grpcio-tools "
            f"{metadata.version('grpcio-tools')}; the pinned dev version generates the committed "
            f"files). Run `make proto` and commit.\n{diff[:4000]}"
        )
