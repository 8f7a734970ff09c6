"""The shim's inference marks span from the outermost module call to the app's last read of
what it returned. Under replay (and streaming) ``forward()`` returns proxies at once and the app
waits when it reads them; a mark that ended with ``forward()`` left that wait, and its energy,
outside the inference (the benchmark's rrto energy was ~10x too low). Also: per inference, the
round trips the app waited through, for a benchmark's measured window."""

from __future__ import annotations

import collections
import threading
import time
import types

import torch
from torch import nn

from rrto_plugins.torch.interceptor import TorchInterceptor
from rrto_plugins.torch.proxy import Handle, new_proxy


class _Channel:
    answers_marks = True

    def __init__(self) -> None:
        self.marks: list[tuple[int, int, int]] = []
        self.threads: list[int] = []
        self.waited: list[int] = []
        self.left: list[bool] = []

    def mark(self, index: int, start_ns: int, end_ns: int, thread: int = 0,
             search_wait_us: int = 0, left_replay: bool = False) -> None:
        self.marks.append((index, start_ns, end_ns))
        self.threads.append(thread)
        self.waited.append(search_wait_us)
        self.left.append(left_replay)


class _Session:
    """What the interceptor uses of a RemoteSession."""

    def __init__(self) -> None:
        self.channel = _Channel()
        self.counters: collections.Counter[str] = collections.Counter()
        self.replay = None
        self.lost = None
        self.on_read = None
        self.mode = "stream"
        self.epoch = 0
        self.released: list[int] = []
        self.threads: dict[int, int] = {}

    def inference_started(self) -> None:
        pass

    def thread_index(self) -> int:
        return self.threads.setdefault(threading.get_ident(), len(self.threads))


def _proxy(session: _Session, oid: int) -> torch.Tensor:
    return new_proxy(Handle(session, oid), (2,), (1,), 0, torch.float32, "cpu")  # type: ignore[arg-type]


def _interceptor(monkeypatch) -> tuple[TorchInterceptor, _Session, nn.Module]:
    monkeypatch.setenv("RRTO_STATS", "1")
    session = _Session()
    icpt = TorchInterceptor(session)  # type: ignore[arg-type]
    session.on_read = icpt._read  # what install() does, without global hooks
    model = nn.Linear(2, 2)
    icpt.offloaded.update(model.modules())  # not offloaded: the session is a stand-in
    return icpt, session, model


def _infer(icpt: TorchInterceptor, model: nn.Module, output: object) -> int:
    icpt._pre(model, ())
    icpt._post(model, (), output)
    return time.monotonic_ns()


def test_mark_ends_with_the_last_read_of_the_outputs(monkeypatch) -> None:
    icpt, session, model = _interceptor(monkeypatch)
    a, b = _proxy(session, 11), _proxy(session, 12)
    returned = _infer(icpt, model, (a, b))
    assert session.channel.marks == []  # outputs unread: the inference is not over
    session.counters["round_trips"] += 1  # the app waits for a reply meanwhile
    icpt._read(11)
    icpt._read(99)  # another proxy read in between: the app is still at it
    assert session.channel.marks == []
    time.sleep(0.002)
    icpt._read(12)
    ((index, start, end),) = session.channel.marks
    assert index == 1 and start < returned < end
    assert end - returned >= 2_000_000  # the wait before the last read is inside the mark
    assert icpt.stats()["by_inference"] == {"index": [1], "round_trips": [1], "push_waits": [0],
                                            "replays": [0], "mismatches": [0], "switches": [0],
                                            "cut": [0], "resumed": [0]}


def test_unread_outputs_end_at_the_next_inference_or_at_exit(monkeypatch) -> None:
    icpt, session, model = _interceptor(monkeypatch)
    _infer(icpt, model, _proxy(session, 21))
    icpt._read(22)  # read something else: extends the open inference
    read_at = time.monotonic_ns()
    _infer(icpt, model, {"out": [_proxy(session, 31)]})  # outputs in a dict of lists
    ((first, _, end),) = session.channel.marks
    assert first == 1 and end <= read_at
    icpt.close_marks()  # at exit
    assert [m[0] for m in session.channel.marks] == [1, 2]


def test_outputs_that_are_not_proxies_end_the_mark_with_forward(monkeypatch) -> None:
    icpt, session, model = _interceptor(monkeypatch)
    returned = _infer(icpt, model, torch.zeros(2))  # e.g. computed locally
    ((_, start, end),) = session.channel.marks
    assert start <= end <= returned


def test_a_mark_names_the_thread_whose_inference_it_ends(monkeypatch) -> None:
    """The robot takes a mark as where that thread's next inference starts: one closed at exit,
    from another thread, still names the thread that ran the inference."""
    icpt, session, model = _interceptor(monkeypatch)
    _infer(icpt, model, torch.zeros(2))  # main thread: index 0, closed at once
    worker = threading.Thread(target=_infer, args=(icpt, model, _proxy(session, 41)))
    worker.start()
    worker.join()
    icpt.close_marks()  # the worker's outputs were never read
    assert session.channel.threads == [0, 1]


def test_a_mark_says_how_long_the_app_waited_for_searches_since_the_previous_one(
        monkeypatch) -> None:
    """The robot charges its hint budget with what the app really waited (``SearchHint``):
    each mark carries the replay client's search waits since the previous mark, waits
    outside any inference (set-up) included."""
    icpt, session, model = _interceptor(monkeypatch)
    session.replay = types.SimpleNamespace(counters={"search_wait_ns": 0},
                                           runs_here=lambda thread: None,
                                           left_inference=lambda: False)
    session.replay.counters["search_wait_ns"] = 3_000_000  # before the first inference
    _infer(icpt, model, torch.zeros(2))
    session.replay.counters["search_wait_ns"] = 3_500_000
    _infer(icpt, model, torch.zeros(2))
    _infer(icpt, model, torch.zeros(2))
    assert session.channel.waited == [3000, 500, 0]


def test_the_mark_of_an_inference_that_left_its_replay_is_flagged_and_its_answer_awaited(
        monkeypatch) -> None:
    """An inference that left its replay and forwarded after it: its mark says so
    (``left_replay``), and the replay client is told to wait for the robot's answer before
    the mark goes, so that the answer cannot come first. The others are not flagged."""
    icpt, session, model = _interceptor(monkeypatch)
    left = [False, True, False]
    awaited: list[int] = []
    session.replay = types.SimpleNamespace(
        counters={"search_wait_ns": 0}, runs_here=lambda thread: None,
        left_inference=lambda: left.pop(0),
        await_answer=lambda: awaited.append(len(session.channel.marks)))
    for _ in range(3):
        _infer(icpt, model, torch.zeros(2))
    assert session.channel.left == [False, True, False]
    assert awaited == [1]  # before the second mark was written
    session.channel.answers_marks = False  # a loopback: nothing would answer
    left.append(True)
    _infer(icpt, model, torch.zeros(2))
    assert session.channel.left[-1] is False and awaited == [1]
