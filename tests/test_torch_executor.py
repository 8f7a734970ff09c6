"""The host executor driven with raw frames, as the GPU daemon drives it."""

from __future__ import annotations

import pytest
import torch

from rrto.v1 import ops_pb2
from rrto_plugins.torch import codec
from rrto_plugins.torch.executor import TorchExecutor
from rrtod.executor import ExecutorContext
from rrtod.gpu.blobstore import BlobStore
from rrtod.wire import hash_of


def make(tmp_path, quota=1 << 20, **kw) -> TorchExecutor:
    blobs = kw.get("blobs") or BlobStore(tmp_path / "blobs", 1 << 20)
    ctx = ExecutorContext(device="cpu", memory_quota=quota, allow_extra=kw.get("allow", ()),
                          deny=kw.get("deny", ()), blobs=blobs, state_dir=tmp_path,
                          identity=kw.get("identity", "local"))
    ex = TorchExecutor(ctx)
    ready = ex.open(ops_pb2.SessionOpen(app="t", executor="torch"))
    assert ready.device == "cpu" and ready.session
    return ex


def up(t: torch.Tensor, bind: int = 0) -> ops_pb2.Value:
    return ops_pb2.Value(tensor=ops_pb2.TensorRef(upload=codec.tensor_data(t), bind_id=bind))


def ref(i: int) -> ops_pb2.Value:
    return ops_pb2.Value(tensor=ops_pb2.TensorRef(id=i))


def call(ex, op, args, out_ids=(), seq=1, **kw) -> list[ops_pb2.SessionDown]:
    c = ops_pb2.OpCall(seq=seq, op=op, args=args, out_ids=list(out_ids), **kw)
    return list(ex.handle(ops_pb2.SessionUp(call=c)))


def fetch(ex, i, seq=99) -> ops_pb2.SessionDown:
    (down,) = ex.handle(ops_pb2.SessionUp(fetch=ops_pb2.Fetch(seq=seq, id=i)))
    return down


def test_streamed_call_store_and_fetch(tmp_path):
    ex = make(tmp_path)
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    assert call(ex, "aten::add.Tensor", [up(a, bind=1), up(b)], out_ids=[2]) == []
    got = fetch(ex, 2)
    assert got.fetched.seq == 99
    assert torch.equal(codec.from_tensor_data(got.fetched.tensor), a + b)
    assert call(ex, "aten::mul.Tensor", [ref(1), ref(2)], out_ids=[3], seq=2) == []
    assert torch.equal(codec.from_tensor_data(fetch(ex, 3).fetched.tensor), a * (a + b))
    assert ex.stats()["ops"] == 2 and ex.stats()["tensors"] == 3


def test_sync_and_want_meta_and_values(tmp_path):
    ex = make(tmp_path)
    x = torch.tensor([0.0, 2.0, 0.0, 3.0])
    (down,) = call(ex, "aten::nonzero.default", [up(x, bind=1)], want_meta=True, sync=True)
    assert list(down.result.outs[0].shape) == [2, 1]
    new_id = down.result.value.tensor.id
    assert new_id and torch.equal(codec.from_tensor_data(fetch(ex, new_id).fetched.tensor),
                                  torch.tensor([[1], [3]]))
    (down,) = call(ex, "aten::_local_scalar_dense.default", [ref(1)], seq=2)
    # a non-tensor result always comes back, even for a streamed call
    (one,) = call(ex, "aten::select.int", [ref(1), ops_pb2.Value(i=0), ops_pb2.Value(i=3)],
                  out_ids=[5], seq=3, sync=True)
    assert one.result.seq == 3
    (down,) = call(ex, "aten::_local_scalar_dense.default", [ref(5)], seq=4)
    assert down.result.value.f == 3.0


def test_views_share_quota_bytes_and_release_frees(tmp_path):
    ex = make(tmp_path)
    call(ex, "aten::view.default", [up(torch.zeros(256), bind=1),
                                    ops_pb2.Value(list=ops_pb2.ValueList(
                                        items=[ops_pb2.Value(i=16), ops_pb2.Value(i=16)]))],
         out_ids=[2])
    assert ex.stats()["bytes_live"] == 1024 and ex.stats()["tensors"] == 2
    list(ex.handle(ops_pb2.SessionUp(release=ops_pb2.Release(ids=[1]))))
    assert ex.stats()["bytes_live"] == 1024
    list(ex.handle(ops_pb2.SessionUp(release=ops_pb2.Release(ids=[2]))))
    assert ex.stats()["bytes_live"] == 0 and ex.stats()["tensors"] == 0


def test_replay_release_frees_like_a_release_frame(tmp_path):
    """``replay.release(ids)``, how a replay frees values after their last use, does what a
    ``Release`` frame of those ids does: the storage is uncharged once no id holds it, a
    poisoned id is forgotten, an unknown id is ignored."""
    ex = make(tmp_path)
    call(ex, "aten::view.default", [up(torch.zeros(256), bind=1),
                                    ops_pb2.Value(list=ops_pb2.ValueList(
                                        items=[ops_pb2.Value(i=16), ops_pb2.Value(i=16)]))],
         out_ids=[2])
    call(ex, "aten::from_file.default", [], out_ids=[3])  # refused: 3 is poisoned
    assert fetch(ex, 3).error.code == "POISONED"
    ex.replay.release([1, 3, 99])
    assert ex.stats()["bytes_live"] == 1024 and ex.stats()["tensors"] == 1
    assert fetch(ex, 3).error.code == "UNKNOWN_TENSOR"
    ex.replay.release([2])
    assert ex.stats()["bytes_live"] == 0 and ex.stats()["tensors"] == 0


@pytest.mark.parametrize("op", ["aten::from_file.default", "torchvision::nms.default",
                                "aten::set_.source_Storage", "not an op"])
def test_refused_operator_says_so_and_poisons_outputs(tmp_path, op):
    ex = make(tmp_path)
    (err,) = call(ex, op, [up(torch.zeros(2))], out_ids=[7], seq=5)
    assert err.error.code == "OP_NOT_ALLOWED" and err.error.seq == 5
    # a call that uses the failed output fails quietly; the download names the root cause
    assert call(ex, "aten::relu.default", [ref(7)], out_ids=[8], seq=6) == []
    down = fetch(ex, 8)
    assert down.error.code == "POISONED" and "OP_NOT_ALLOWED" in down.error.message
    assert ex.stats()["ops"] == 0


def test_deny_and_allow_extra(tmp_path):
    ex = make(tmp_path, deny=("aten::relu",))
    (err,) = call(ex, "aten::relu.default", [up(torch.zeros(2))], out_ids=[1])
    assert err.error.code == "OP_NOT_ALLOWED" and "denied" in err.error.message


def test_quota_exceeded_on_upload_and_on_output(tmp_path):
    ex = make(tmp_path, quota=4096)
    (err,) = call(ex, "aten::relu.default", [up(torch.zeros(2048))], out_ids=[1])
    assert err.error.code == "QUOTA_EXCEEDED" and "4096-byte memory quota" in err.error.message
    call(ex, "aten::clone.default", [up(torch.zeros(512), bind=1)], out_ids=[2], seq=2)
    (err,) = call(ex, "aten::repeat.default", [ref(1), ops_pb2.Value(list=ops_pb2.ValueList(
        items=[ops_pb2.Value(i=4)]))], out_ids=[3], seq=3)
    assert err.error.code == "QUOTA_EXCEEDED"
    assert ex.stats()["bytes_live"] <= 4096
    # the session still works after the refusal, within its quota
    list(ex.handle(ops_pb2.SessionUp(release=ops_pb2.Release(ids=[1]))))
    assert call(ex, "aten::relu.default", [ref(2)], out_ids=[4], seq=4) == []


def test_op_failure_is_reported_with_the_operator(tmp_path):
    ex = make(tmp_path)
    (err,) = call(ex, "aten::mm.default", [up(torch.zeros(2, 3)), up(torch.zeros(2, 3))],
                  out_ids=[1], seq=9)
    assert err.error.code == "OP_FAILED" and "aten::mm.default (call 9)" in err.error.message


def test_bad_frames_never_raise(tmp_path):
    ex = make(tmp_path)
    bad = codec.tensor_data(torch.zeros(4))
    bad.data = b"\x00"
    (err,) = call(ex, "aten::relu.default", [ops_pb2.Value(tensor=ops_pb2.TensorRef(upload=bad))],
                  out_ids=[1])
    assert err.error.code == "BAD_FRAME"
    (err,) = call(ex, "aten::relu.default", [ref(12345)], out_ids=[1], seq=2)
    assert err.error.code == "UNKNOWN_TENSOR"
    (err,) = ex.handle(ops_pb2.SessionUp())
    assert err.error.code == "BAD_FRAME"
    (err,) = call(ex, "aten::relu.default", [], out_ids=[1], seq=3)
    assert err.error.code == "OP_FAILED"


def test_output_meta_without_dtype_neither_fails_nor_sizes_anything(tmp_path):
    """Found by tests/fuzz (peer_session): an out_meta without a dtype raised CodecError out of
    the call's setup, answered as INTERNAL (a host bug). The host now sizes outputs itself and
    reads only the declared layout, so such a call runs and its value is right."""
    ex = make(tmp_path)
    frame = ops_pb2.SessionUp(call=ops_pb2.OpCall(seq=7, op="aten::relu.default",
                                                  args=[up(torch.ones(2))], out_ids=[1]))
    frame.call.out_meta.add()
    assert list(ex.handle(frame)) == []
    assert torch.equal(codec.from_tensor_data(fetch(ex, 1).fetched.tensor), torch.ones(2))
    ex.close()


def test_persistent_tensors_by_hash(tmp_path):
    ex = make(tmp_path)
    w = codec.tensor_data(torch.randn(8))
    key = hash_of(w)
    (q,) = ex.handle(ops_pb2.SessionUp(query=ops_pb2.BlobQuery(hashes=[key])))
    assert list(q.query.missing) == [key]
    bad = ops_pb2.BlobPut(hash=b"\x00" * 16, tensor=w)
    (err,) = ex.handle(ops_pb2.SessionUp(blob=bad))
    assert err.error.code == "BLOB_INVALID"
    assert list(ex.handle(ops_pb2.SessionUp(blob=ops_pb2.BlobPut(hash=key, tensor=w)))) == []
    pers = ops_pb2.Value(tensor=ops_pb2.TensorRef(persistent=key, bind_id=1))
    call(ex, "aten::relu.default", [pers], out_ids=[2])
    assert torch.equal(codec.from_tensor_data(fetch(ex, 1).fetched.tensor),
                       codec.from_tensor_data(w))
    ex.close()
    # another session (or a restarted host) finds it in the cache
    ex2 = make(tmp_path)
    (q,) = ex2.handle(ops_pb2.SessionUp(query=ops_pb2.BlobQuery(hashes=[key])))
    assert list(q.query.missing) == []
    (err,) = call(ex2, "aten::relu.default", [ops_pb2.Value(tensor=ops_pb2.TensorRef(
        persistent=b"\x01" * 16, bind_id=1))], out_ids=[2])
    assert err.error.code == "BLOB_MISSING"


@pytest.mark.parametrize("shared", [False, True])
def test_weight_cache_entries_of_one_identity_are_missing_to_another(tmp_path, shared):
    """Robot A's weights are not B's to use (or to learn of) unless the cache is shared."""
    blobs = BlobStore(tmp_path / "blobs", 1 << 20, shared=shared)
    w = codec.tensor_data(torch.randn(8))
    key = hash_of(w)
    a = make(tmp_path, blobs=blobs, identity="robot-a")
    assert list(a.handle(ops_pb2.SessionUp(blob=ops_pb2.BlobPut(hash=key, tensor=w)))) == []
    a.close()
    b = make(tmp_path, blobs=blobs, identity="robot-b")
    (q,) = b.handle(ops_pb2.SessionUp(query=ops_pb2.BlobQuery(hashes=[key])))
    assert list(q.query.missing) == ([] if shared else [key])
    pers = ops_pb2.Value(tensor=ops_pb2.TensorRef(persistent=key, bind_id=1))
    out = list(call(b, "aten::neg.default", [pers], out_ids=[2]))
    if shared:
        assert torch.equal(codec.from_tensor_data(fetch(b, 2).fetched.tensor),
                           -codec.from_tensor_data(w))
    else:
        (err,) = out
        assert err.error.code == "BLOB_MISSING"
    b.close()
    again = make(tmp_path, blobs=blobs, identity="robot-a")  # A still has it
    (q,) = again.handle(ops_pb2.SessionUp(query=ops_pb2.BlobQuery(hashes=[key])))
    assert list(q.query.missing) == []


def test_sessions_are_isolated_and_close_frees(tmp_path):
    a, b = make(tmp_path), make(tmp_path)
    call(a, "aten::clone.default", [up(torch.ones(3))], out_ids=[1])
    assert fetch(b, 1).error.code == "UNKNOWN_TENSOR"
    a.close()
    assert a.stats()["bytes_live"] == 0 and a.stats()["tensors"] == 0


def test_open_quota_can_only_lower(tmp_path):
    ex = TorchExecutor(ExecutorContext(device="cpu", memory_quota=1000, allow_extra=(), deny=(),
                                       blobs=BlobStore(tmp_path, 1 << 20), state_dir=tmp_path))
    ex.open(ops_pb2.SessionOpen(memory_quota=10**9))
    assert ex.stats()["memory_quota"] == 1000


def test_written_ids_snapshot_and_restore_for_replay(tmp_path):
    """Replay support: which arguments a call writes in place (from the schema, and the
    composite batch norm that updates running statistics unannounced), and snapshots of them
    that restore in place."""
    ex = make(tmp_path, allow=("aten::_native_batch_norm_legit",))  # training mode: not listed
    c = ops_pb2.OpCall(op="aten::_native_batch_norm_legit.default")
    for v in (ref(1), ref(2), ref(3), ref(4), ref(5), ops_pb2.Value(b=True),
              ops_pb2.Value(f=0.1), ops_pb2.Value(f=1e-5)):
        c.args.add().CopyFrom(v)
    assert ex.written_ids(c) == [4, 5]
    for op in ("aten::batch_norm.default", "aten::native_batch_norm.default"):
        c.op = op
        assert ex.written_ids(c) == [4, 5]  # training=True, though the schema does not say
    c.args[5].b = False
    assert ex.written_ids(c) == []
    assert ex.written_ids(ops_pb2.OpCall(op="aten::relu_.default", args=[ref(7)])) == [7]
    call(ex, "aten::zeros.default", [ops_pb2.Value(list=ops_pb2.ValueList(
        items=[ops_pb2.Value(i=3)]))], out_ids=[7])
    token = ex.snapshot([7, 8])  # 8 does not exist: nothing to protect
    call(ex, "aten::relu_.default", [ref(7)], out_ids=[7])
    call(ex, "aten::add_.Tensor", [ref(7), up(torch.ones(3))], out_ids=[7], seq=2)
    assert codec.from_tensor_data(fetch(ex, 7).fetched.tensor).tolist() == [1.0, 1.0, 1.0]
    ex.restore(token)
    assert codec.from_tensor_data(fetch(ex, 7, seq=100).fetched.tensor).tolist() == [0.0] * 3


def test_prepared_call_computes_what_forwarding_computes(tmp_path):
    """Replay's fast path (``prepare`` once, ``run_prepared`` per inference) fills tensors into
    positional, nested (a tensor list) and keyword arguments in ``iter_tensor_refs`` order."""
    ex = make(tmp_path)
    a, b, c = torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)
    for i, t in enumerate((a, b, c), start=1):
        call(ex, "aten::clone.default", [up(t)], out_ids=[i], seq=i)
    cat = ops_pb2.OpCall(op="aten::cat.default", out_ids=[10], args=[
        ops_pb2.Value(list=ops_pb2.ValueList(items=[ref(100), ref(101)])), ops_pb2.Value(i=1)])
    add = ops_pb2.OpCall(op="aten::add.Tensor", out_ids=[11], args=[ref(100), ref(101)],
                         kwargs={"alpha": ops_pb2.Value(f=0.5)})
    p_cat, p_add = ex.prepare(cat), ex.prepare(add)
    assert list(ex.run_prepared(p_cat, [3, 1], [20])) == []
    assert list(ex.run_prepared(p_add, [2, ops_pb2.TensorRef(upload=codec.tensor_data(a))],
                                [21])) == []
    assert torch.equal(codec.from_tensor_data(fetch(ex, 20).fetched.tensor), torch.cat([c, a], 1))
    assert torch.equal(codec.from_tensor_data(fetch(ex, 21).fetched.tensor), b + 0.5 * a)
    # an unknown argument fails like a forwarded call: an error, and the output is poisoned
    (down,) = ex.run_prepared(p_add, [2, 77], [22])
    assert down.error.code == "UNKNOWN_TENSOR"
    assert fetch(ex, 22).error.code == "POISONED"
    assert ex.stats()["ops"] == 5
    with pytest.raises(Exception, match="not allowed|from_file"):
        ex.prepare(ops_pb2.OpCall(op="aten::from_file.default"))


def test_prepared_call_takes_this_inferences_integers_and_answers_like_forwarding(tmp_path):
    """Calls with symbolic integers (``view(x, [n, 4])``, n a size of this inference) and calls
    the app is answered (``want_meta``) run on the fast path too: the integers go in at their
    paths, the bytes the call allocates are sized per integer values, and the reply is the one
    the forwarded call with those integers gets."""
    ex = make(tmp_path)
    x = torch.arange(24.0)
    call(ex, "aten::clone.default", [up(x)], out_ids=[1])
    recorded = ops_pb2.OpCall(op="aten::view.default", out_ids=[10], args=[
        ref(100), ops_pb2.Value(list=ops_pb2.ValueList(items=[ops_pb2.Value(i=2),
                                                              ops_pb2.Value(i=12)]))])
    p = ex.prepare(recorded)
    assert list(ex.run_prepared(p, [1], [20], ints=[([1, 0], 6), ([1, 1], 4)])) == []
    assert torch.equal(codec.from_tensor_data(fetch(ex, 20).fetched.tensor), x.view(6, 4))
    (fast,) = ex.run_prepared(p, [1], [21], ints=[([1, 0], 3), ([1, 1], 8)], want_meta=True)
    slow_call = ops_pb2.OpCall()
    slow_call.CopyFrom(recorded)
    slow_call.args[0].tensor.id, slow_call.out_ids[0] = 1, 22
    slow_call.args[1].list.items[0].i, slow_call.args[1].list.items[1].i = 3, 8
    (slow,) = call(ex, "aten::view.default", slow_call.args, out_ids=[22], want_meta=True)
    assert list(fast.result.outs) == list(slow.result.outs)
    assert list(fast.result.outs[0].shape) == [3, 8]
    assert list(p.args[1]) == [2, 12]  # the prepared arguments stay as recorded
    # the integers are part of what sizes the call: a wrong count is the operator's own error
    (bad,) = ex.run_prepared(p, [1], [23], ints=[([1, 0], 5), ([1, 1], 4)])
    assert bad.error.code == "OP_FAILED"


def test_schema_hash_is_compared_once_and_a_mismatch_refuses_the_operator(tmp_path):
    from rrto_plugins.torch.schemas import schema_hash

    ex = make(tmp_path)
    ex.open(ops_pb2.SessionOpen(app="t", executor="torch", versions={"torch": "0.0-other"}))
    relu, neg = torch.ops.aten.relu.default, torch.ops.aten.neg.default
    x = torch.arange(4.0)
    # another torch: a sequence naming an operator not compared in this session is refused
    with pytest.raises(ValueError, match="aten::relu.default has not been compared"):
        ex.written_ids(ops_pb2.OpCall(op="aten::relu.default", args=[ref(1)]))
    assert call(ex, "aten::relu.default", [up(x)], [1], seq=1, sync=True,
                schema=schema_hash(relu))[0].WhichOneof("msg") == "result"
    assert ex.written_ids(ops_pb2.OpCall(op="aten::relu.default", args=[ref(1)])) == []
    # a different schema: refused with both versions and the host's schema, then every call
    (down,) = call(ex, "aten::neg.default", [ref(1)], [2], seq=2, sync=True,
                   schema=schema_hash(relu))
    assert down.error.code == "SCHEMA_MISMATCH" and down.error.seq == 2
    assert ("operator aten::neg.default has a different schema in the app (torch 0.0-other"
            in down.error.message)
    assert f"this host (torch {torch.__version__}: {neg._schema})" in down.error.message
    (down,) = call(ex, "aten::neg.default", [ref(1)], [3], seq=3, sync=True)
    assert down.error.code == "SCHEMA_MISMATCH"
    with pytest.raises(ValueError, match="different schema"):
        ex.written_ids(ops_pb2.OpCall(op="aten::neg.default", args=[ref(1)]))
    assert ex.stats()["schema_mismatches"] == 1


def test_same_torch_on_both_ends_accepts_sequences_without_comparison(tmp_path):
    ex = make(tmp_path)
    ex.open(ops_pb2.SessionOpen(app="t", executor="torch", versions={"torch": torch.__version__}))
    assert ex.written_ids(ops_pb2.OpCall(op="aten::relu_.default", args=[ref(1)])) == [1]
