"""The shim's hot path (``plugins/torch/hotpath.py``, ``shimstep.cpp``): a replayed call that
meets a step exactly as before is answered as the general path answers it, and anything else is
left to the general path having changed nothing - in Python and in C++ alike."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
import torch

from rrto.v1 import ops_pb2
from rrto_plugins.torch import hotpath, native
from rrto_plugins.torch.client import TIMED_SHARE, RemoteSession
from rrto_plugins.torch.proxy import Handle, RemoteTensor, new_proxy
from rrto_plugins.torch.replay import RELEASE_STREAM_AT
from testkit.channels import Channel

SRC = ops_pb2.SeqSource
SHAPE, STRIDE = (1, 4, 2, 2), (16, 4, 2, 1)
VARYING = 7  # the position of the call whose sizes the host pushes
WEIGHT_HASH = b"w" * 16
BUILT = native.module("shimstep") is not None


def test_the_native_hot_path_is_built_in_ci():
    """CI builds it at install (``make install``): there the native tests below must run."""
    if os.environ.get("CI") != "true":
        pytest.skip("outside CI the build may be missing: the native cases skip then")
    assert BUILT, native.library("shimstep")


def definition(grad: int) -> ops_pb2.SequenceDef:
    """``add(x, c) -> mul(., w) -> leaky_relu(., 0.2) -> sum(., [1], True) -> mul(., .) ->
    relu_(.) -> cat([., .], 0) -> mul(., .)``: an upload and a constant, a bound weight, a
    plain float, a list and a bool, a value written in place, a list of tensors, and a last
    call whose sizes follow the data (the host pushes them)."""
    d = ops_pb2.SequenceDef(id=9, local_ids=[2, 3, 4, 5, 6, 7, 8], outputs=[8],
                            varies_from=VARYING)
    meta = ops_pb2.TensorMeta(dtype="float32", shape=SHAPE, stride=STRIDE)
    summed = ops_pb2.TensorMeta(dtype="float32", shape=[1, 1, 2, 2], stride=[4, 4, 2, 1])

    def call(op: str, out: int, out_meta: ops_pb2.TensorMeta) -> ops_pb2.OpCall:
        return d.calls.add(op=op, out_ids=[out], out_meta=[out_meta], grad_mode=grad)

    first = call("aten::add.Tensor", 2, meta)
    first.args.add().tensor.upload.meta.CopyFrom(meta)
    d.sources.add(kind=SRC.INPUT)
    first.args.add().tensor.id = 77
    d.sources.add(kind=SRC.CONSTANT, id=77)
    weighted = call("aten::mul.Tensor", 3, meta)
    weighted.args.add().tensor.id = 2
    d.sources.add(kind=SRC.PRODUCED, id=2)
    weighted.args.add().tensor.persistent = WEIGHT_HASH
    d.sources.add(kind=SRC.PERSISTENT, hash=WEIGHT_HASH)
    leaky = call("aten::leaky_relu.default", 4, meta)
    leaky.args.add().tensor.id = 3
    d.sources.add(kind=SRC.PRODUCED, id=3)
    leaky.args.add().f = 0.2
    total = call("aten::sum.dim_IntList", 5, summed)
    total.args.add().tensor.id = 4
    d.sources.add(kind=SRC.PRODUCED, id=4)
    total.args.add().list.items.add().i = 1
    total.args.add().b = True
    square = call("aten::mul.Tensor", 6, summed)
    for _ in range(2):
        square.args.add().tensor.id = 5
        d.sources.add(kind=SRC.PRODUCED, id=5)
    inplace = call("aten::relu_.default", 6, summed)
    inplace.args.add().tensor.id = 6
    d.sources.add(kind=SRC.PRODUCED, id=6)
    joined = ops_pb2.TensorMeta(dtype="float32", shape=CAT, stride=[4, 4, 2, 1])
    cat = call("aten::cat.default", 7, joined)
    items = cat.args.add().list.items
    for _ in range(2):
        items.add().tensor.id = 6
        d.sources.add(kind=SRC.PRODUCED, id=6)
    varying = call("aten::mul.Tensor", 8, joined)
    for _ in range(2):
        varying.args.add().tensor.id = 7
        d.sources.add(kind=SRC.PRODUCED, id=7)
    return d


SUMMED, CAT = (1, 1, 2, 2), (2, 1, 2, 2)


class App:
    """A session replaying ``define``'s definition with the hot path ``kind`` ("python",
    "native", or "off": the general path only)."""

    def __init__(self, kind: str, define: Callable[[int], ops_pb2.SequenceDef] = definition):
        self.channel = Channel()
        self.session = s = RemoteSession(self.channel)
        if kind == "python":
            s.hot = hotpath.HotPath(s, s.replay, s.journal, random.random, TIMED_SHARE,
                                    RELEASE_STREAM_AT)
        elif kind == "native":
            if not BUILT:
                pytest.skip("the native hot path is not built")
            s.hot = hotpath.make(s, s.replay, s.journal, random.random, TIMED_SHARE,
                                 RELEASE_STREAM_AT)
            assert type(s.hot).__name__ == "HotPath" and not isinstance(s.hot, hotpath.HotPath)
        else:
            s.hot = None
        self.constant = new_proxy(Handle(s, 77), SHAPE, STRIDE, 0, torch.float32,
                                  torch.device("cpu"))
        self.weight = new_proxy(Handle(s, 1 << 40, WEIGHT_HASH, torch.ones(SHAPE)), SHAPE,
                                STRIDE, 0, torch.float32, torch.device("cpu"))
        self.weight._rrto_handle.bound = False
        with torch.no_grad():
            s.replay.define(define(hotpath.grad_mode()))

    def calls(self, x: torch.Tensor) -> Iterator[tuple[Any, tuple]]:
        """The inference's calls, each with the previous one's result as it was answered."""
        y = yield torch.ops.aten.add.Tensor, (x, self.constant)
        y = yield torch.ops.aten.mul.Tensor, (y, self.weight)
        y = yield torch.ops.aten.leaky_relu.default, (y, 0.2)
        y = yield torch.ops.aten.sum.dim_IntList, (y, [1], True)
        y = yield torch.ops.aten.mul.Tensor, (y, y)
        y = yield torch.ops.aten.relu_.default, (y,)
        y = yield torch.ops.aten.cat.default, ([y, y],)
        yield torch.ops.aten.mul.Tensor, (y, y)

    def push_sizes(self, dims: tuple[int, ...] = CAT) -> None:
        """The host's ``ReplaySizes`` for the last call of the inference under way."""
        self.session.replay.sized(ops_pb2.ReplaySizes(
            base_id=self.active.base, positions=[VARYING], ranks=[len(dims)], dims=dims))

    def infer(self, x: torch.Tensor) -> list[Any]:
        """One inference through ``RemoteTensor`` as torch calls it; what each call gave."""
        out, calls = [], self.calls(x)
        func, args = next(calls)
        with torch.no_grad():
            while True:
                result = func(*args)
                if not out:
                    self.push_sizes()
                out.append(result)
                try:
                    func, args = calls.send(result)
                except StopIteration:
                    return out

    @property
    def active(self) -> Any:
        return getattr(self.session.replay._tls, "active", None)

    def state(self) -> tuple[Any, ...]:
        """What a call changes: the replay's position and counters, the journal, the frames."""
        act = self.active
        return (None if act is None else act.position, dict(self.session.replay.counters),
                len(self.session.journal), len(self.channel.frames))


def described(proxy: Any, base: int) -> tuple[Any, ...]:
    return (type(proxy), tuple(proxy.shape), proxy.stride(), proxy.storage_offset(),
            proxy.dtype, proxy.device, proxy.requires_grad, proxy._rrto_handle.id - base,
            proxy._rrto_handle.session)


def journal_of(app: App, base: int) -> list[Any]:
    """The journal's entries with this inference's ids made relative to its base, and
    weights by their hash."""
    def rel(token: Any) -> Any:
        if isinstance(token, tuple) and len(token) == 2 and isinstance(token[1], int):
            return (token[0], token[1] - base if token[1] >= base else token[1])
        if isinstance(token, tuple) and len(token) == 2 and isinstance(token[1], Handle):
            return (token[0], token[1].hash)
        if isinstance(token, tuple) and len(token) == 3:  # a local tensor: (mark, it, version)
            return (token[0], id(token[1]), token[2])
        return token
    return [(func, [rel(a) for a in args], kwargs, [o - base for o in outs])
            for func, args, kwargs, outs in app.session.journal._calls[-8:]]


@pytest.mark.parametrize("kind", ["python", "native"])
def test_a_replayed_inference_is_answered_as_the_general_path_answers_it(kind):
    """Every call of a steady inference after the first is the hot path's; each proxy, the
    journal, the replay's counters and the frames sent are those of the general path."""
    results: dict[str, list[Any]] = {}
    x = torch.rand(SHAPE)
    for k in (kind, "off"):
        app = App(k)
        for _ in range(3):
            out = app.infer(x)
            base = app.session.replay._bases and max(app.session.replay._bases)
            assert app.active is None  # the inference ended with its last step
        results[k] = [[described(p, base) for p in out], journal_of(app, base),
                      app.session.replay.counters["replayed_ops"],
                      [f.WhichOneof("msg") if hasattr(f, "WhichOneof") else type(f).__name__
                       for f in app.channel.frames]]
        hot = app.session.replay.counters["hot"]
        # The general path's: the first inference's first replay of each step, every
        # inference's first call (an upload), and the second's last (its first of pushed
        # sizes). The rest: the hot path's.
        assert hot == (0 if k == "off" else 6 + 7), k
        assert app.session.replay.counters["sized"] == 2
    same = lambda rows: [[r[:-1] for r in rows[0]], *rows[1:]]  # noqa: E731 (sessions differ)
    assert same(results[kind]) == same(results["off"])


@contextmanager
def _holding(container: Any, item: Any, value: Any = None) -> Iterator[None]:
    """``item`` in ``container`` (a dict, set or list the native hot path holds: changed in
    place) while the block runs."""
    if isinstance(container, dict):
        container[item] = value
    elif isinstance(container, set):
        container.add(item)
    else:
        container.append(item)
    try:
        yield
    finally:
        if isinstance(container, list):
            container.remove(item)
        elif isinstance(container, dict):
            del container[item]
        else:
            container.discard(item)


@contextmanager
def perturbed(app: App, how: str) -> Iterator[Callable[[Any, tuple], tuple[Any, tuple]]]:
    """A state or a call the hot path must leave to the general path: yields how the call is
    changed (most leave it as it is)."""
    s, replay, act = app.session, app.session.replay, app.active
    same = lambda func, args: (func, args)  # noqa: E731
    attributes = {"lost": (s, "lost", "gone"), "failed": (act.seq, "failed", True),
                  "joined": (act, "joined", {}), "timed": (act, "timing", [0] * 9),
                  "local": (act.seq.fast[act.position].info, "local", True)}
    items = {"assigning": (s._assigning, 0), "late": (s._late, 12345),
             "diverged": (s.diverged, 12345), "give_up": (replay._give_up, 12345),
             "broken": (replay._broken, act.base, (9, ops_pb2.Error()))}
    if how in attributes:
        with mock.patch.object(*attributes[how]):
            yield same
    elif how in items:
        with _holding(*items[how]):
            yield same
    elif how == "grad":
        with torch.enable_grad():
            yield same
    elif how in ("a longer list", "a tuple for the list", "a local tensor in the list"):
        yield {"a longer list": lambda f, a: (f, ([*a[0], a[0][0]],)),
               "a tuple for the list": lambda f, a: (f, (tuple(a[0]),)),
               "a local tensor in the list": lambda f, a: (f, ([a[0][0], torch.ones(SUMMED)],)),
               }[how]
    elif how == "made by the robot":
        yield lambda f, a: (f, (_robot_value(app),))
    elif how == "sizes not pushed":
        known = replay._sizes.pop(act.base)
        yield same
        replay._sizes[act.base] = known
    elif how == "sizes of another rank":
        known = replay._sizes[act.base]
        replay._sizes[act.base] = {VARYING: (1, 1, 4)}
        yield same
        replay._sizes[act.base] = known
    elif how == "sizes no tensor has":
        known = replay._sizes[act.base]
        replay._sizes[act.base] = {VARYING: (1 << 62, 1 << 62, 2, 2)}  # strides overflow
        yield same
        replay._sizes[act.base] = known
    else:
        yield {
            "other op": lambda f, a: (torch.ops.aten.add.Tensor, a),
            "more args": lambda f, a: (f, (*a, 1)),
            "other value": lambda f, a: (f, (a[0], 0.3)),
            "other type": lambda f, a: (f, (a[0], 1)),
            "proxy of another inference": lambda f, a: (f, (_proxy(app, 5), a[1])),
            "a local tensor": lambda f, a: (f, (torch.ones(SHAPE), a[1])),
            "a weight twin": lambda f, a: (f, (a[0], _twin(app))),
        }[how]


def _proxy(app: App, oid: int) -> RemoteTensor:
    return new_proxy(Handle(app.session, oid), SHAPE, STRIDE, 0, torch.float32,
                     torch.device("cpu"))


def _robot_value(app: App) -> RemoteTensor:
    """This inference's value at the written argument, as a robot step leaves it: its data
    here too (``Handle.local``)."""
    act = app.active
    h = Handle(app.session, act.base + 4, None, torch.ones(SUMMED))
    return new_proxy(h, SUMMED, (4, 4, 2, 1), 0, torch.float32, torch.device("cpu"))


def _twin(app: App) -> RemoteTensor:
    """A weight of the same content as the bound one, another tensor (a reloaded model)."""
    t = new_proxy(Handle(app.session, (1 << 40) + 1, WEIGHT_HASH, torch.ones(SHAPE)), SHAPE,
                  STRIDE, 0, torch.float32, torch.device("cpu"))
    return t


CASES = ["lost", "assigning", "late", "diverged", "give_up", "broken", "failed", "joined",
         "timed", "local", "grad", "other op", "more args", "other value", "other type",
         "proxy of another inference", "a local tensor", "a weight twin", "made by the robot",
         "sizes not pushed", "sizes of another rank", "sizes no tensor has", "a longer list",
         "a tuple for the list", "a local tensor in the list"]
STOP_AT = {"other value": 2, "other type": 2, "made by the robot": 5, "a longer list": 6,
           "a tuple for the list": 6, "a local tensor in the list": 6, "sizes not pushed": 7,
           "sizes of another rank": 7, "sizes no tensor has": 7}  # else 1, ``mul`` by ``w``


def steady(kind: str) -> tuple[App, Iterator[tuple[Any, tuple]], Any, tuple]:
    """An app two inferences in, stopped in its third after the first call (an upload): the
    next call's operator and arguments, and the calls after it."""
    app = App(kind)
    x = torch.rand(SHAPE)
    app.infer(x)
    app.infer(x)
    calls = app.calls(x)
    func, args = next(calls)
    with torch.no_grad():
        func, args = calls.send(func(*args))
    return app, calls, func, args


@pytest.mark.parametrize("kind", ["python", "native"])
@pytest.mark.parametrize("how", CASES)
def test_anything_else_is_left_to_the_general_path_with_nothing_changed(kind, how):
    """Stopped at a step the hot path knows (``mul`` by the bound weight, ``leaky_relu`` by a
    float, ``relu_``, the call whose sizes the host pushes), each perturbation makes it say
    None and leave the replay, the counters, the journal and the frames as they were."""
    app, calls, func, args = steady(kind)
    with torch.no_grad():
        app.push_sizes()
        for _ in range(STOP_AT.get(how, 1) - 1):
            func, args = calls.send(func(*args))
    assert app.active is not None and app.active.seq.fast[app.active.position]
    before = app.state()
    with torch.no_grad(), perturbed(app, how) as change:
        f, a = change(func, args)
        answer = app.session.hot(f, a)
        assert type(answer) is type(None)  # (a proxy's repr would wait for the host)
        assert app.state() == before
    with torch.no_grad():  # and the call as it was is the hot path's
        assert type(app.session.hot(func, args)) is RemoteTensor
    assert app.state()[0] == (None if before[0] + 1 == VARYING + 1 else before[0] + 1)


@pytest.mark.parametrize("kind", ["python", "native"])
def test_a_call_with_keyword_arguments_takes_the_general_path(kind, monkeypatch):
    """The hot path sees positional calls only: at a step it knows, the same call with a
    keyword argument goes to the general path (with the native dispatch installed too)."""
    app, calls, func, args = steady(kind)
    general: list[Any] = []
    with torch.no_grad():
        monkeypatch.setattr(app.session, "dispatch",
                            lambda f, a, kw: general.append((f, kw)) or _proxy(app, 1))
        before = app.state()
        # as torch hands over a call with a keyword-only argument that is not its default
        RemoteTensor.__torch_dispatch__(func, (RemoteTensor,), args, {"alpha": 2})
    assert general == [(func, {"alpha": 2})] and app.state() == before
    if kind == "native":
        current = RemoteTensor.__dict__["__torch_dispatch__"].__func__
        assert type(current).__name__ == "Dispatch"


def answered_definition(grad: int) -> ops_pb2.SequenceDef:
    """``add(x, c) -> nonzero(.) -> add(., .)``: the ``nonzero`` is answered by the host (its
    sizes follow the data), the last call's sizes are pushed."""
    d = ops_pb2.SequenceDef(id=11, local_ids=[2, 3, 4], outputs=[4], varies_from=1)
    meta = ops_pb2.TensorMeta(dtype="float32", shape=SHAPE, stride=STRIDE)
    found = ops_pb2.TensorMeta(dtype="int64", shape=[3, 4], stride=[4, 1])
    first = d.calls.add(op="aten::add.Tensor", out_ids=[2], out_meta=[meta], grad_mode=grad)
    first.args.add().tensor.upload.meta.CopyFrom(meta)
    d.sources.add(kind=SRC.INPUT)
    first.args.add().tensor.id = 77
    d.sources.add(kind=SRC.CONSTANT, id=77)
    nonzero = d.calls.add(op="aten::nonzero.default", out_ids=[3], out_meta=[found],
                          grad_mode=grad, want_meta=True)
    nonzero.args.add().tensor.id = 2
    d.sources.add(kind=SRC.PRODUCED, id=2)
    doubled = d.calls.add(op="aten::add.Tensor", out_ids=[4], out_meta=[found], grad_mode=grad)
    for _ in range(2):
        doubled.args.add().tensor.id = 3
        d.sources.add(kind=SRC.PRODUCED, id=3)
    return d


def _nonzero_answer(base: int, shape: tuple[int, ...]) -> ops_pb2.ReplayAnswer:
    """The host's answer to the ``nonzero`` (position 1) of inference ``base``: ``shape``."""
    answer = ops_pb2.ReplayAnswer(base_id=base, position=1)
    strides = (shape[1], 1) if len(shape) == 2 else (1,)
    answer.result.outs.add(dtype="int64", shape=shape, stride=strides)
    answer.result.value.tensor.id = base + 1
    return answer


@pytest.mark.parametrize("kind", ["python", "native", "off"])
def test_an_answered_call_of_one_new_dense_tensor_is_the_hot_paths_from_its_answer(kind):
    """A data-dependent call the host answers (``nonzero``) is made on the hot path from the
    answer's sizes, once its first answer showed one new C-contiguous tensor under the step's
    id: each inference's proxy has that inference's count, as the general path would make it.
    Where its answer has not come, or has another rank, the hot path says None and changes
    nothing, and the general path answers it as the host said."""
    app = App(kind, answered_definition)
    s, replay = app.session, app.session.replay
    x = torch.rand(SHAPE)
    made = []
    for n in (3, 5, 2, 6):
        with torch.no_grad():
            y = torch.ops.aten.add.Tensor(x, app.constant)
            base = app.active.base
            shape = (n, 4) if n != 6 else (n,)  # the last: an answer of another rank
            if n == 2:  # not answered yet: left to the general path, nothing changed
                before = app.state()
                assert s.hot is None or s.hot(torch.ops.aten.nonzero.default, (y,)) is None
                assert app.state() == before
            replay.answered(_nonzero_answer(base, shape))
            hot = replay.counters["hot"]
            found = torch.ops.aten.nonzero.default(y)
            took = replay.counters["hot"] - hot
            replay.sized(ops_pb2.ReplaySizes(base_id=base, positions=[2], ranks=[len(shape)],
                                             dims=shape))
            torch.ops.aten.add.Tensor(found, found)
        assert app.active is None  # the inference ended with its last step
        made.append((described(found, base), took))
    dense = [(RemoteTensor, (n, 4), (4, 1), 0, torch.int64, torch.device("cpu"), False, 1,
              s) for n in (3, 5, 2)]
    assert [m for m, _ in made[:3]] == dense
    assert made[3][0][1:3] == ((6,), (1,))  # as answered, by the general path
    # the first answer is the general path's (it shows the layout); the next ones the hot
    # path's, but for one of another rank
    assert [t for _, t in made] == ([0, 0, 0, 0] if kind == "off" else [0, 1, 1, 0])
