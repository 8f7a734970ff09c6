"""Activation: rrto-run, RRTO_OFFLOAD with the .pth hook, fallback with one warning line,
chaining to an existing sitecustomize, and no cost for programs that never import torch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rrtod.shim import site
from rrtod.switches import SWITCHES
from testkit.apps import app_env

BIN = Path(sys.executable).parent
APP = textwrap.dedent("""
    import sys
    import torch
    from torch import nn
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    with torch.no_grad():
        y = m(torch.ones(1, 4))
    print(type(y).__name__, y.tolist())
""")


def run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """No daemon config or socket (unless ``extra`` names them)."""
    return app_env(**{"RRTO_CONFIG": str(tmp_path / "absent.yaml"),
                      "RRTO_SOCKET": str(tmp_path / "no-such.sock"), **extra})


def test_no_daemon_runs_locally_with_one_warning(tmp_path):
    (tmp_path / "app.py").write_text(APP)
    local = run([sys.executable, "app.py"], clean_env(tmp_path), tmp_path)
    off = run([str(BIN / "rrto-run"), sys.executable, "app.py"], clean_env(tmp_path), tmp_path)
    assert off.returncode == 0, off.stderr
    assert off.stdout == local.stdout and off.stdout.startswith("Tensor ")
    lines = off.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rrto: warning:") and "running locally" in lines[0]


def test_fallback_error_fails_at_torch_import(tmp_path):
    (tmp_path / "app.py").write_text(APP)
    out = run([str(BIN / "rrto-run"), "--fallback", "error", "--", sys.executable, "app.py"],
              clean_env(tmp_path), tmp_path)
    assert out.returncode != 0 and "cannot offload" in out.stderr


def test_offload_zero_disables_with_one_warning(tmp_path):
    (tmp_path / "app.py").write_text(APP)
    out = run([str(BIN / "rrto-run"), sys.executable, "app.py"],
              clean_env(tmp_path, RRTO_OFFLOAD="0"), tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("Tensor ")
    assert out.stderr.strip().splitlines() == [
        "rrto: warning: RRTO_OFFLOAD=0: offloading disabled, running locally"]


@pytest.mark.parametrize("value", ["false", "no", "OFF", " 0 "])
def test_every_false_spelling_disables_rrto_run(tmp_path, value):
    (tmp_path / "app.py").write_text(APP)
    out = run([str(BIN / "rrto-run"), sys.executable, "app.py"],
              clean_env(tmp_path, RRTO_OFFLOAD=value), tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("Tensor ")
    assert out.stderr.strip().splitlines() == [
        f"rrto: warning: RRTO_OFFLOAD={value}: offloading disabled, running locally"]


def test_an_unreadable_switch_is_an_error_naming_it(tmp_path):
    out = run([str(BIN / "rrto-run"), sys.executable, "-c", "pass"],
              clean_env(tmp_path, RRTO_OFFLOAD="maybe"), tmp_path)
    assert out.returncode == 2 and "RRTO_OFFLOAD='maybe'" in out.stderr


def test_disabled_backend_is_not_loaded_by_the_shim(tmp_path):
    (tmp_path / "app.py").write_text(APP)
    out = run([str(BIN / "rrto-run"), sys.executable, "app.py"],
              clean_env(tmp_path, RRTO_DISABLE_PLUGINS="torch"), tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("Tensor ")
    assert "disabled by RRTO_DISABLE_PLUGINS" in out.stderr


def test_readme_lists_every_switch():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    for name in SWITCHES:
        assert f"| `{name}` |" in readme, name


def test_existing_sitecustomize_keeps_working(tmp_path):
    mine = tmp_path / "mysite"
    mine.mkdir()
    (mine / "sitecustomize.py").write_text("import builtins\nbuiltins.APP_SITE = 'ran'\n")
    (tmp_path / "app.py").write_text("import builtins, sys\nprint(builtins.APP_SITE, "
                                     "'rrtod.shim.boot' in sys.modules)\n")
    env = clean_env(tmp_path, PYTHONPATH=str(mine))
    out = run([str(BIN / "rrto-run"), sys.executable, "app.py"], env, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ran", "True"]


def test_programs_without_torch_pay_nothing(tmp_path):
    (tmp_path / "app.py").write_text(
        "import sys\nprint(sorted(m for m in sys.modules if m.startswith(('torch', 'rrto'))))\n")
    out = run([str(BIN / "rrto-run"), sys.executable, "app.py"], clean_env(tmp_path), tmp_path)
    assert out.returncode == 0 and out.stderr == ""
    # not even the rrtod package: the boot hook and the switch parser, both standard library only
    assert out.stdout.strip() == "['rrtod.shim.boot', 'rrtod.switches']"


def test_pth_hook_runs_only_when_enabled(tmp_path):
    sitedir = tmp_path / "sp"
    sitedir.mkdir()
    path = site.install_pth(str(sitedir))
    assert path.read_text() == site.PTH_LINE and path.name == site.PTH_NAME
    probe = (f"import site, sys; site.addsitedir({str(sitedir)!r}); "
             "print('rrtod.shim.boot' in sys.modules)")
    off = run([sys.executable, "-c", probe], clean_env(tmp_path), tmp_path)
    on = run([sys.executable, "-c", probe], clean_env(tmp_path, RRTO_OFFLOAD="1"), tmp_path)
    assert off.stdout.strip() == "False" and on.stdout.strip() == "True"
    assert site.uninstall_pth(str(sitedir)) and not path.exists()


def test_pth_hook_activates_on_torch_import(tmp_path):
    sitedir = tmp_path / "sp"
    sitedir.mkdir()
    site.install_pth(str(sitedir))
    (tmp_path / "app.py").write_text(f"import site; site.addsitedir({str(sitedir)!r})\n" + APP)
    out = run([sys.executable, "app.py"], clean_env(tmp_path, RRTO_OFFLOAD="1"), tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("Tensor ")
    assert "no rrtod socket" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_site_dir_is_private(tmp_path):
    d = site.site_dir()
    assert (d / "sitecustomize.py").read_text() == site.SITECUSTOMIZE
    assert d.stat().st_mode & 0o077 == 0 and d.stat().st_uid == os.getuid()
