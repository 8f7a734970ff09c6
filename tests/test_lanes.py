"""Lanes (plugins/torch/lanes.py): the wire's thread index, handed between app threads only
between inferences. Each test runs its steps on real threads, one step at a time."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from typing import Any

from rrto_plugins.torch.lanes import Lanes


class Worker:
    """A thread that runs the steps given to it, one at a time, and stays alive between them."""

    def __init__(self) -> None:
        self._jobs: list[Callable[[], Any]] = []
        self._ready = threading.Condition()
        self._result: list[Any] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._jobs:
                    self._ready.wait()
                job = self._jobs.pop(0)
            if job is None:
                return
            out = job()
            with self._ready:
                self._result.append(out)
                self._ready.notify_all()

    def do(self, job: Callable[[], Any]) -> Any:
        with self._ready:
            self._jobs.append(job)
            self._ready.notify_all()
            while not self._result:
                self._ready.wait(5)
            return self._result.pop()

    def stop(self) -> None:
        with self._ready:
            self._jobs.append(None)  # type: ignore[arg-type]
            self._ready.notify_all()
        self._thread.join(5)


def test_a_thread_keeps_its_lane_from_one_inference_to_the_next():
    lanes = Lanes()
    assert lanes.begin() == 0
    lanes.end()
    assert lanes.lane() == 0
    assert lanes.begin() == 0 and lanes.lane() == 0


def test_threads_that_take_turns_share_lane_0():
    """A ends its inference; B begins one and takes lane 0; A, which has no lane now, takes
    a provisional one for a call, and moves back to lane 0 at its next inference once B
    ended its own."""
    lanes, a, b = Lanes(), Worker(), Worker()
    try:
        assert a.do(lanes.begin) == 0
        a.do(lanes.end)
        assert b.do(lanes.begin) == 0
        assert a.do(lanes.lane) == 1  # B is inside its inference: not taken from it
        b.do(lanes.end)
        assert a.do(lanes.begin) == 0
        assert b.do(lanes.lane) == 1
    finally:
        a.stop()
        b.stop()


def test_threads_whose_inferences_overlap_hold_lanes_of_their_own():
    lanes, a, b = Lanes(), Worker(), Worker()
    try:
        assert a.do(lanes.begin) == 0
        assert b.do(lanes.begin) == 1
        a.do(lanes.end)
        assert a.do(lanes.begin) == 0  # each keeps its own from one inference to the next
        b.do(lanes.end)
        assert b.do(lanes.begin) == 1
        assert lanes.held() == [0, 1]
    finally:
        a.stop()
        b.stop()


def test_a_call_outside_an_inference_never_takes_another_threads_lane():
    """A helper thread that computes on an output between a steady thread's inferences takes
    a lane no thread holds: the steady thread keeps lane 0 and its sequences."""
    lanes, steady, helper = Lanes(), Worker(), Worker()
    try:
        assert steady.do(lanes.begin) == 0
        steady.do(lanes.end)
        assert helper.do(lanes.lane) == 1
        assert steady.do(lanes.lane) == 0
        assert steady.do(lanes.begin) == 0
    finally:
        steady.stop()
        helper.stop()


def test_a_thread_that_ends_gives_its_lane_back():
    """A thread that dies inside an inference (it never ended it) holds its lane no longer."""
    lanes = Lanes()
    took: list[int] = []
    t = threading.Thread(target=lambda: took.append(lanes.begin()))
    t.start()
    t.join()
    del t
    gc.collect()
    assert took == [0]
    assert lanes.held() == []
    assert lanes.begin() == 0
