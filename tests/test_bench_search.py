"""``bench.search``'s recording of a real app through the shim's loopback channel: the frames
and inference marks it logs are what the search benchmark feeds its recorders. It broke once
unnoticed when the channel's ``mark`` took a new keyword (``thread``)."""

from __future__ import annotations

from pathlib import Path

from rrto.v1 import ops_pb2


def test_a_test_app_is_recorded_with_its_frames_and_inference_marks(tmp_path: Path) -> None:
    from bench.search import record_app

    rec = record_app("mlp_policy", 3, tmp_path)
    marks = [e[1] for e in rec.events if e[0] == "mark"]
    calls = [e[1] for e in rec.events if e[0] == "frame" and e[1].WhichOneof("msg") == "call"]
    assert marks == sorted(marks) and len(marks) >= 2, marks
    assert calls and all(isinstance(c, ops_pb2.SessionUp) for c in calls)
    assert set(rec.inference_of.values()) >= {1, 2}
