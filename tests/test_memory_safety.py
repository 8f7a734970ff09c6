"""Memory safety of the host executor (issue 10, findings 1 and 4), driven with raw frames.

No operator may reach memory outside its session's tensors, whatever the allowlist admits: the
out-of-bounds tests resolve operators through an allow-everything list so that they exercise
the output bound check itself. Sizes come from the host, never from the client: the quota and
the daemon-wide memory limit refuse a call before it allocates.
"""

from __future__ import annotations

import pytest
import torch

from rrto.v1 import ops_pb2
from rrto_plugins.torch import codec
from rrtod.gpu.memory import HostMemory
from testkit.executors import MiB, call, fetch, ints, make, meta, ref, up


@pytest.mark.parametrize("elements", [65_536, 1 << 18])
def test_alias_beyond_its_storage_is_bad_view_and_never_data(tmp_path, elements):
    """A 16-byte upload aliased to 64 KiB (1 MiB) returned the daemon's heap (crashed it)."""
    ex = make(tmp_path, allow_all=True)
    (err,) = call(ex, "aten::_reshape_alias.default",
                  [up(torch.arange(4.0), bind=1), ints(elements), ints(1)], out_ids=[2],
                  out_meta=[meta([elements])], sync=True)
    assert err.error.code == "BAD_VIEW" and "outside its 16-byte storage" in err.error.message
    down = fetch(ex, 2)
    assert down.error.code == "POISONED" and "BAD_VIEW" in down.error.message
    # writing through it is refused as well: fill_ never runs on a value that was not stored
    (err,) = call(ex, "aten::fill_.Scalar", [ref(2), ops_pb2.Value(f=1.0)], out_ids=[2], seq=2,
                  sync=True)
    assert err.error.code == "POISONED"
    # the session goes on: its own tensors are intact, new calls run
    assert codec.from_tensor_data(fetch(ex, 1).fetched.tensor).tolist() == [0.0, 1.0, 2.0, 3.0]
    assert call(ex, "aten::neg.default", [ref(1)], out_ids=[3], seq=3) == []
    assert codec.from_tensor_data(fetch(ex, 3).fetched.tensor).tolist() == [-0.0, -1, -2, -3]
    assert ex.stats()["bytes_live"] == 32


def test_in_bounds_views_pass(tmp_path):
    """Views inside their storage (a slice with an offset, a transpose, an empty view, a
    stride-0 expansion) are what models make all the time: they pass the check."""
    ex = make(tmp_path, allow_all=True)
    call(ex, "aten::clone.default", [up(torch.arange(12.0))], out_ids=[1])
    assert call(ex, "aten::_reshape_alias.default", [ref(1), ints(3, 4), ints(4, 1)],
                out_ids=[2]) == []
    assert call(ex, "aten::slice.Tensor", [ref(1), ops_pb2.Value(i=0), ops_pb2.Value(i=8)],
                out_ids=[3]) == []
    assert call(ex, "aten::t.default", [ref(2)], out_ids=[4]) == []
    assert call(ex, "aten::_reshape_alias.default", [ref(1), ints(0, 5), ints(1000, 1)],
                out_ids=[5]) == []
    assert call(ex, "aten::expand.default", [ref(3), ints(1000, 4)], out_ids=[6]) == []
    got = codec.from_tensor_data(fetch(ex, 4).fetched.tensor)
    assert torch.equal(got, torch.arange(12.0).reshape(3, 4).t())
    # an offset view that reaches one element too far is refused
    (err,) = call(ex, "aten::_reshape_alias.default", [ref(3), ints(5), ints(1)], out_ids=[7],
                  sync=True)
    assert err.error.code == "BAD_VIEW"
    (err,) = call(ex, "aten::as_strided.default", [ref(1), ints(2), ints(1),
                                                  ops_pb2.Value(i=11)], out_ids=[8], sync=True)
    assert err.error.code == "OP_FAILED"  # as_strided checks its own bounds: torch refuses


def test_in_place_metadata_change_out_of_bounds_drops_the_tensor(tmp_path):
    """An operator that changes a live tensor's sizes in place is checked through the
    argument it writes; the tensor is dropped from the session rather than kept out of
    bounds (``_reshape_alias`` into ``as_strided_``'s argument cannot happen, so exercise it
    with ``resize_`` on a view, which torch keeps in bounds by growing the storage)."""
    ex = make(tmp_path, allow_all=True)
    call(ex, "aten::clone.default", [up(torch.arange(4.0))], out_ids=[1])
    call(ex, "aten::slice.Tensor", [ref(1), ops_pb2.Value(i=0), ops_pb2.Value(i=2)],
         out_ids=[2])
    assert call(ex, "aten::resize_.default", [ref(2), ints(64)], out_ids=[2]) == []
    assert ex.stats()["bytes_live"] >= 64 * 4 - 16  # charged (at least) what it grew by


# -- finding 4: sizes come from the host ------------------------------------------------------
def test_output_size_is_computed_on_the_host_not_declared_by_the_client(tmp_path):
    """``ones`` of 8 KiB declared as one element, against a 4 KiB quota: refused before it
    allocates (the message names the real size)."""
    ex = make(tmp_path, quota=4096)
    (err,) = call(ex, "aten::ones.default", [ints(2048)], out_ids=[1], out_meta=[meta([1])],
                  sync=True)
    assert err.error.code == "QUOTA_EXCEEDED" and "needs 8192 bytes" in err.error.message
    assert ex.stats()["bytes_live"] == 0 and ex.store.pending == 0
    # a client-declared layout with huge strides never sizes an allocation either
    assert call(ex, "aten::ones.default", [ints(2, 2)], out_ids=[2],
                out_meta=[ops_pb2.TensorMeta(dtype="float32", shape=[2, 2],
                                             stride=[1 << 40, 1])]) == []
    assert ex.stats()["bytes_live"] == 16


def test_data_dependent_outputs_are_bounded_by_their_inputs(tmp_path):
    # sizing, not the allowlist, is under test: repeat_interleave is on no positive list
    ex = make(tmp_path, quota=4096, allow_all=True)
    x = torch.tensor([0.0, 2.0, 0.0, 3.0])
    (down,) = call(ex, "aten::nonzero.default", [up(x, bind=1)], want_meta=True, sync=True)
    assert list(down.result.outs[0].shape) == [2, 1]
    mask = torch.tensor([True, False, True, True])
    (down,) = call(ex, "aten::index.Tensor", [ref(1), ops_pb2.Value(list=ops_pb2.ValueList(
        items=[up(mask)]))], want_meta=True, sync=True, seq=2)
    assert list(down.result.outs[0].shape) == [3]
    (down,) = call(ex, "aten::_unique2.default", [ref(1)], want_meta=True, sync=True, seq=3)
    assert down.WhichOneof("msg") == "result"
    # the bound, not the data, decides: 600 elements could be nonzero (4800 bytes of indices)
    (err,) = call(ex, "aten::nonzero.default", [up(torch.zeros(600))], want_meta=True,
                  sync=True, seq=4)
    assert err.error.code == "QUOTA_EXCEEDED"
    # no bound at all: refused with the reason
    (err,) = call(ex, "aten::repeat_interleave.Tensor", [up(torch.tensor([3, 1]))],
                  want_meta=True, sync=True, seq=5)
    assert err.error.code == "OP_NOT_ALLOWED" and "output_size" in err.error.message
    (down,) = call(ex, "aten::repeat_interleave.Tensor", [up(torch.tensor([3, 1]))],
                   kwargs={"output_size": ops_pb2.Value(i=4)}, want_meta=True, sync=True, seq=6)
    assert list(down.result.outs[0].shape) == [4]
    # where(condition) is nonzero by another name (torchvision's detectors send it)
    (down,) = call(ex, "aten::where.default", [ref(1)], want_meta=True, sync=True, seq=7)
    assert [list(o.shape) for o in down.result.outs] == [[2]]
    (down,) = call(ex, "aten::where.self", [up(mask), ref(1), ref(1)], want_meta=True,
                   sync=True, seq=8)
    assert [list(o.shape) for o in down.result.outs] == [[4]]


def test_shape_errors_found_on_meta_tensors_are_op_failed(tmp_path):
    ex = make(tmp_path)
    (err,) = call(ex, "aten::mm.default", [up(torch.zeros(2, 3)), up(torch.zeros(2, 3))],
                  out_ids=[1], seq=9)
    assert err.error.code == "OP_FAILED" and "aten::mm.default (call 9)" in err.error.message


@pytest.mark.parametrize("op, second", [
    ("aten::view.default", ops_pb2.Value(list=ops_pb2.ValueList(items=[ops_pb2.Value(i=7)]))),
    ("aten::add.Tensor", None),  # pointwise, operands that do not broadcast
])
def test_calls_sized_without_meta_execution_still_fail_as_the_operator_does(tmp_path, op,
                                                                            second):
    """Views and pointwise calls skip meta execution (``sizing``): a call that cannot run is
    still OP_FAILED, naming it, its output poisoned, and the session goes on serving."""
    ex = make(tmp_path)
    args = [up(torch.zeros(2, 3)), second if second is not None else up(torch.zeros(4))]
    (err,) = call(ex, op, args, out_ids=[1], seq=9)
    assert err.error.code == "OP_FAILED" and f"{op} (call 9)" in err.error.message
    assert fetch(ex, 1).error.code == "POISONED"
    assert call(ex, "aten::add.Tensor", [up(torch.ones(2)), up(torch.ones(2))], out_ids=[2],
                seq=10) == []


def test_replayed_call_is_sized_by_its_inputs_metadata(tmp_path):
    """A prepared (replayed) call caches its size per metadata of its tensor arguments: the
    same call with a larger input is sized again, not taken from the recorded call."""
    ex = make(tmp_path, quota=64 * 1024)
    rep = ops_pb2.OpCall(op="aten::repeat.default", out_ids=[10], args=[ref(100), ints(4)],
                         out_meta=[meta([16])])
    p = ex.prepare(rep)
    small = ops_pb2.TensorRef(upload=codec.tensor_data(torch.ones(4)))
    assert list(ex.run_prepared(p, [small], [20])) == []
    big = ops_pb2.TensorRef(upload=codec.tensor_data(torch.ones(4096)))  # 16 KiB -> 64 KiB
    (err,) = ex.run_prepared(p, [big], [21])
    assert err.error.code == "QUOTA_EXCEEDED" and "needs 65536 bytes" in err.error.message
    assert len(p.sizes) == 2


def test_a_plain_replayed_call_keeps_every_check_on_its_short_path(tmp_path):
    """From its second replay at the same sizes a plain call (one tensor out, nothing
    written) takes the executor's short path (``_run_plain``): the same values and bytes as
    the general path, and a call over the quota or making an out-of-bounds view still fails
    with its error, its output poisoned, nothing charged."""
    ex = make(tmp_path, quota=MiB, allow_all=True)
    x = torch.randn(64)
    call(ex, "aten::clone.default", [up(x)], out_ids=[1], seq=1)
    neg = ex.prepare(ops_pb2.OpCall(op="aten::neg.default", out_ids=[10], args=[ref(100)],
                                    out_meta=[meta([64])]))
    assert neg.plain
    assert list(ex.run_prepared(neg, [1], [20])) == []  # the general path: sizes learnt
    held = ex.store.held
    assert list(ex.run_prepared(neg, [1], [21])) == []  # the short path
    assert ex.store.held == held + 256 and ex.stats()["ops"] == 3
    for i in (20, 21):
        assert torch.equal(codec.from_tensor_data(fetch(ex, i).fetched.tensor), -x)
    ex.store.quota = ex.store.held + 100  # the next output does not fit
    (err,) = ex.run_prepared(neg, [1], [22])
    assert err.error.code == "QUOTA_EXCEEDED" and fetch(ex, 22).error.code == "POISONED"
    assert ex.store.held == held + 256 and ex.store.pending == 0
    ex.store.quota = MiB
    wide = ex.prepare(ops_pb2.OpCall(
        op="aten::_reshape_alias.default", out_ids=[11], args=[ref(100), ints(128), ints(1)],
        out_meta=[meta([128])]))
    assert wide.plain
    for out in (30, 31):  # the general path, then (sizes known) the short one: both refuse
        (err,) = ex.run_prepared(wide, [1], [out])
        assert err.error.code == "BAD_VIEW" and fetch(ex, out).error.code == "POISONED"
    assert ex.store.held == held + 256 and ex.store.pending == 0


def test_a_plain_call_with_a_new_size_or_a_tensor_list_takes_the_short_path(tmp_path,
                                                                           monkeypatch):
    """``x[idx]`` (``index.Tensor``, its index inside a list) with an index of a new length
    every replay, as a detector's per-class loop makes them: the short path works out the
    bytes from the sizing rules itself instead of leaving every new size to the general path
    (~3 us a call less): the same values and charge, and what the general path refuses it
    still refuses (with the general path's error: it runs the call again)."""
    ex = make(tmp_path, quota=MiB, allow_all=True)
    x = torch.randn(500, 4)
    call(ex, "aten::clone.default", [up(x)], out_ids=[1], seq=1)
    index = ex.prepare(ops_pb2.OpCall(
        op="aten::index.Tensor", out_ids=[10],
        args=[ref(100), ops_pb2.Value(list=ops_pb2.ValueList(items=[ref(101)]))],
        out_meta=[meta([3, 4])]))
    assert index.plain
    general = ex._execute
    monkeypatch.setattr(ex, "_execute", lambda *a: pytest.fail("took the general path"))
    for n, out in ((3, 20), (7, 21), (11, 22)):  # a new length each time
        idx = torch.randint(0, 500, (n,))
        ex.store.put(100 + n, idx)
        held = ex.store.held
        assert list(ex.run_prepared(index, [1, 100 + n], [out])) == []
        assert ex.store.held == held + n * 4 * 4
        assert torch.equal(ex.store.get(out), x[idx])
    monkeypatch.setattr(ex, "_execute", general)
    ex.store.put(200, torch.tensor([0, 500]))  # out of range: the operator raises
    (err,) = ex.run_prepared(index, [1, 200], [30])
    assert err.error.code == "OP_FAILED" and fetch(ex, 30).error.code == "POISONED"
    ex.store.put(201, torch.zeros(20000, dtype=torch.int64))
    ex.store.quota = ex.store.held + 100  # 320 KB of output does not fit
    (err,) = ex.run_prepared(index, [1, 201], [31])
    assert err.error.code == "QUOTA_EXCEEDED" and ex.store.pending == 0


def test_host_memory_limit_is_shared_by_all_sessions(tmp_path):
    """Six sessions of 4 MiB each against a 10 MiB host limit: the first two fit, the later
    ones are refused; closing a session gives its memory back."""
    host = HostMemory(10 * MiB)
    sessions = [make(tmp_path, quota=8 * MiB, host=host) for _ in range(6)]
    codes = []
    for ex in sessions:
        downs = call(ex, "aten::empty.memory_format", [ints(MiB)], out_ids=[1], sync=True)
        codes.append(downs[0].WhichOneof("msg") if downs else "ok")
        codes[-1] = downs[0].error.code if codes[-1] == "error" else codes[-1]
    assert codes[:2] == ["result", "result"]
    assert codes[2:] == ["QUOTA_EXCEEDED"] * 4
    assert host.used == 8 * MiB
    err = call(sessions[2], "aten::empty.memory_format", [ints(MiB)], out_ids=[1], sync=True)
    assert "10485760-byte memory limit (executor.memory_limit)" in err[0].error.message
    sessions[0].close()
    assert host.used == 4 * MiB
    assert call(sessions[2], "aten::empty.memory_format", [ints(MiB)], out_ids=[1],
                sync=True)[0].WhichOneof("msg") == "result"
    for ex in sessions:
        ex.close()
    assert host.used == 0


def test_default_host_limit_is_half_the_device_memory(tmp_path):
    import psutil

    host = HostMemory(None)
    make(tmp_path, host=host)
    assert host.limit == psutil.virtual_memory().total // 2


def test_queued_replies_count_against_the_session(tmp_path):
    """Replies waiting to be sent hold memory too: the executor counts them (the daemon's
    Outbox charges and refunds them) and says when there is no room."""
    host = HostMemory(MiB)
    ex = make(tmp_path, quota=512 * 1024, host=host)
    call(ex, "aten::clone.default", [up(torch.zeros(64 * 1024))], out_ids=[1])  # 256 KiB
    assert ex.charge_reply(200 * 1024) is None
    assert ex.stats()["bytes_queued"] == 200 * 1024 and host.used == 456 * 1024
    why = ex.charge_reply(100 * 1024)
    assert why is not None and "memory quota" in why
    # a queued reply also keeps new tensors out
    (err,) = call(ex, "aten::clone.default", [ref(1)], out_ids=[2], sync=True)
    assert err.error.code == "QUOTA_EXCEEDED"
    ex.refund_reply(200 * 1024)
    assert host.used == 256 * 1024
    ex.close()
    ex.refund_reply(10)  # a reply still in flight when the session closed: nothing left to give
    assert host.used == 0
