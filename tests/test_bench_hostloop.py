"""``bench.hostloop``: the host's replay loop against the model's forward in one process. Its
figures are timings and are not asserted; what is: the definition it builds is one the host
accepts, the replay equals the forward bit for bit (else it reports nothing), and the app's
releases read during the replay free the inference's values."""

from __future__ import annotations

import json

import torch

from bench import hostloop
from bench.models import MODELS


def test_replayed_and_bare_calls_equal_the_forward_and_the_values_are_freed(tmp_path):
    spec = MODELS["cnn"]
    model, x = spec.make(), spec.inputs(1)[0]
    d, constants, bare = hostloop.definition(model, x)
    assert len(d.calls) > 5 and [s.kind for s in d.sources].count(hostloop.SRC.INPUT) == 1
    harness = hostloop.Harness(d, constants, str(tmp_path))
    held = harness.executor.store.held  # the constants (weights) only
    with torch.inference_mode():
        for t in spec.inputs(3, seed=5):
            want = model(t)
            got, host_s = harness.replay(t)
            assert torch.equal(got[0], want) and torch.equal(bare(t)[0], want) and host_s > 0
            # every value of the inference was released (the outputs after their push)
            assert harness.executor.store.held == held
    assert harness.replayer.completed == 3 and harness.replayer.aborts == 0


def test_the_command_prints_one_measured_row_per_model(capsys):
    assert hostloop.main(["--models", "mlp", "--rounds", "1", "--per-round", "1", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["model"] == "mlp" and row["calls"] == len(hostloop.definition(
        MODELS["mlp"].make(), MODELS["mlp"].inputs(1)[0])[0].calls)
    assert all(row[k] > 0 for k in ("forward_ms", "bare_ms", "replayed_ms"))
