"""``python -m bench.uploads``: its rows are measured from the codec itself (the bytes each way
are those of the frames it encodes; no timing is asserted)."""

from __future__ import annotations

import json

import torch

from bench import uploads


def test_each_case_reports_the_bytes_its_frame_carries(capsys) -> None:
    uploads.main(["--sizes", "48x64", "--repeat", "1", "--json"])
    rows = {r["input"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    pixels = 3 * 48 * 64
    assert rows["scaled /255"]["coded"] and rows["scaled /255"]["wire_bytes"] == pixels + 256 * 4
    assert rows["normalised (mean, std)"]["wire_bytes"] == pixels + 3 * 256 * 4
    assert not rows["float data"]["coded"]
    assert rows["float data"]["wire_bytes"] == rows["float data"]["raw_bytes"] == 4 * pixels
    assert rows["float data"]["saved_link_ms"] == {str(r): 0.0 for r in uploads.RATES_MBIT}


def test_the_benchmark_can_feed_image_models_normalised_camera_frames(monkeypatch) -> None:
    """``python -m bench --inputs frames``: an image model's inputs are 8-bit frames
    normalised per channel (on a palette of 256 levels a channel); other inputs stay noise."""
    from bench.inputs import INPUTS_ENV
    from bench.models import MODELS
    from rrto_plugins.torch import codec

    monkeypatch.setenv(INPUTS_ENV, "frames")
    frame = MODELS["cnn"].inputs(2)
    coded = codec.palette_of(frame[1])
    assert coded is not None and coded.table.numel() == 3 * codec.PALETTE_LEVELS
    assert not torch.equal(frame[0], frame[1])
    assert codec.palette_of(MODELS["transformer"].inputs(1)[0]) is None  # not an image
    monkeypatch.setenv(INPUTS_ENV, "randn")
    assert codec.palette_of(MODELS["cnn"].inputs(1)[0]) is None
