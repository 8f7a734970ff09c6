"""The compatibility corpus's app idioms (compat/idioms/apps.py) against an in-process host:
each idiom's outputs with the model offloaded equal its outputs run locally, bitwise. The fast
tier of ``make compat`` (which runs them as real apps under ``rrto-run``, with real daemons);
torch only, so it runs on the suite's torch 2.13 CPU build in seconds."""

from __future__ import annotations

import copy

import pytest
import torch

from compat.idioms.apps import IDIOMS, make_model
from rrto_plugins.torch.proxy import RemoteTensor
from rrto_plugins.torch.testing import loopback

# Real processes only: fork/DataLoader workers need a real session socket (test_torch_client
# covers a forked child).
IN_PROCESS = sorted(set(IDIOMS) - {"dataloader_workers", "fork_child"})


def run(name: str) -> list[torch.Tensor]:
    return [torch.as_tensor(o).detach().cpu() for o in IDIOMS[name](make_model(), 5)]


@pytest.mark.parametrize("name", IN_PROCESS)
def test_idiom_offloaded_equals_local(name, tmp_path):
    want = run(name)
    itc = loopback(tmp_path)
    try:
        got = run(name)
        assert itc.session.counters["calls"] > 0  # the model really was offloaded
    finally:
        itc.uninstall()
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)


def test_deepcopy_of_an_offloaded_model_is_a_host_copy(tmp_path):
    """Ultralytics' predict() deep-copies the model after offloading started: this raised
    ``TypeError: cannot pickle 'socket' object``. The copy stays offloaded, and it is a copy:
    an in-place edit of it leaves the original as it was."""
    model, x = make_model(), torch.rand(1, 3, 32, 32)
    itc = loopback(tmp_path)
    try:
        with torch.no_grad():
            want = model(x).cpu()
            twin = copy.deepcopy(model)
            assert isinstance(twin.head.weight, RemoteTensor)
            assert isinstance(twin.head.weight, torch.nn.Parameter)
            assert torch.equal(twin(x).cpu(), want)
            twin.head.bias.add_(1.0)
            assert torch.equal(model(x).cpu(), want)
            # (bias + 1 inside addmm rounds apart from adding 1 to its result)
            assert torch.allclose(twin(x).cpu(), want + 1.0, atol=1e-6)
    finally:
        itc.uninstall()


def test_torch_compile_of_an_offloaded_model_runs_eagerly_with_one_warning(tmp_path, capfd):
    """TorchDynamo cannot trace proxies (the app crashed on its first compiled call): under
    the shim torch.compile, in its three forms, returns its target, which runs offloaded and
    eagerly; one warning line names the pattern, however often the app compiles."""
    model, x, original = make_model(), torch.rand(1, 3, 32, 32), torch.compile
    with torch.no_grad():
        want = model(x)
    itc = loopback(tmp_path)
    try:
        with torch.no_grad():
            model(x)  # offloading started
            calls = itc.session.counters["calls"]
            got = [torch.compile(model, backend="eager")(x).cpu()]
            twin = make_model()
            twin.compile(backend="eager")  # nn.Module.compile: torch.compile of its _call_impl
            got.append(twin(x).cpu())
            got.append(torch.compile(backend="eager")(lambda t: t * 1)(model(x)).cpu())
            assert isinstance(twin.head.weight, RemoteTensor)
            assert itc.session.counters["calls"] > calls  # the compiled calls were offloaded
    finally:
        itc.uninstall()
    assert all(torch.equal(g, want) for g in got)
    warnings = [line for line in capfd.readouterr().err.splitlines() if "rrto: warning" in line]
    assert len(warnings) == 1 and "torch.compile(Net)" in warnings[0], warnings
    assert torch.compile is original  # uninstall() restores it
