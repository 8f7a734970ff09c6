"""The sequence files: one module (``rrtod.robot.sequences``) writes, reads, counts, lists and
deletes them; a damaged file is skipped with a warning, never a crash of the daemon's session
open or of ``rrtoctl sequences|flush``."""

from __future__ import annotations

import base64
import json

from rrto.v1 import ops_pb2
from rrtod.robot.sequences import SequenceStore, fingerprint

SRC = ops_pb2.SeqSource


def definition(seq_id: int, weight: bytes, thread: int = 1) -> ops_pb2.SequenceDef:
    d = ops_pb2.SequenceDef(id=seq_id, thread=thread)
    d.calls.add(op="aten::linear.default")
    d.sources.add(kind=SRC.INPUT)
    d.sources.add(kind=SRC.PERSISTENT, hash=weight)
    return d


def summary(seq_id: int, app: str) -> dict:
    return {"id": seq_id, "app": app, "session": "s1", "thread": 1, "operators": 1,
            "inputs": 1, "outputs": 1, "replays": 0, "mismatches": 0, "created": 1.0}


def test_a_saved_sequence_is_one_file_with_its_summary_and_definition(tmp_path):
    store = SequenceStore(tmp_path / "seq")
    d = definition(5, b"w" * 16)
    store.save("/opt/apps/my app.py", summary(5, "/opt/apps/my app.py"), d)
    (path,) = (tmp_path / "seq").iterdir()
    assert path.name == f"my_app.py-{fingerprint(d)}-t1.json"
    doc = json.loads(path.read_text())
    assert ops_pb2.SequenceDef.FromString(base64.b64decode(doc["definition"])) == d
    assert doc["fingerprint"] == fingerprint(d) and doc["operators"] == 1
    ((loaded, again),) = store.load("/opt/apps/my app.py")
    assert again == d and loaded == summary(5, "/opt/apps/my app.py")
    (listed,) = store.list()
    assert "definition" not in listed and listed["fingerprint"] == fingerprint(d)


def test_counts_add_up_over_sessions_and_forget_deletes_one_file(tmp_path):
    store = SequenceStore(tmp_path)
    store.save("a.py", summary(1, "a.py"), definition(1, b"x" * 16))
    store.save("a.py", summary(2, "a.py"), definition(2, b"y" * 16))
    for _ in range(2):
        store.add_counts("a.py", [{"id": 1, "replays": 3, "mismatches": 1}])
    counts = {s["id"]: (s["replays"], s["mismatches"]) for s in store.list()}
    assert counts == {1: (6, 2), 2: (0, 0)}
    store.forget("a.py", 1)
    assert [s["id"] for s in store.list()] == [2]


def test_apps_whose_names_share_a_slug_keep_their_own_sequences(tmp_path):
    store = SequenceStore(tmp_path)
    store.save("/x/app.py", summary(1, "/x/app.py"), definition(1, b"x" * 16))
    store.save("/y/app.py", summary(2, "/y/app.py"), definition(2, b"y" * 16))
    assert [s["id"] for s, _ in store.load("/x/app.py")] == [1]
    assert store.flush("/y/app.py") == 1
    assert [s["id"] for s in store.list()] == [1]
    assert store.flush() == 1 and store.list() == []


def test_damaged_files_are_skipped_not_fatal(tmp_path):
    store = SequenceStore(tmp_path)
    store.save("a.py", summary(1, "a.py"), definition(1, b"x" * 16))
    (tmp_path / "a.py-broken-t1.json").write_text("{not json")
    (tmp_path / "a.py-array-t1.json").write_text("[1, 2]")
    (tmp_path / "a.py-nodef-t1.json").write_text(json.dumps({"id": [3], "app": "a.py"}))
    assert [s["id"] for s, _ in store.load("a.py")] == [1]
    assert sorted(str(s["id"]) for s in store.list()) == ["1", "[3]"]
    store.add_counts("a.py", [{"id": 1, "replays": 1, "mismatches": 0}])
    store.forget("a.py", 1)
    assert store.flush("a.py") == 1  # the nodef file: the others are not an app's sequence
    assert store.flush() == 2
    assert list(tmp_path.iterdir()) == []


def test_sessions_of_one_app_save_and_count_one_file_concurrently(tmp_path):
    """64 sessions of one app find the same sequence and save it from their search threads,
    and add their counts as they end, while new sessions load it: every write is whole (each
    writer has its own temporary file), so nothing fails and every read parses."""
    import threading

    from structlog.testing import capture_logs

    store = SequenceStore(tmp_path)
    d = definition(1, b"w" * 16)
    store.save("a.py", summary(1, "a.py"), d)
    loaded: list[int] = []

    def session() -> None:
        for _ in range(20):
            store.save("a.py", summary(1, "a.py"), d)
            store.add_counts("a.py", [{"id": 1, "replays": 1, "mismatches": 0}])
            loaded.append(len(store.load("a.py")))

    with capture_logs() as logs:
        threads = [threading.Thread(target=session) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [e for e in logs if e["log_level"] == "warning"] == []
    assert loaded == [1] * 160
    assert [p.name for p in tmp_path.iterdir()] == [f"a.py-{fingerprint(d)}-t1.json"]
