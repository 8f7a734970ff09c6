"""``python -m bench.hostloop``: the host's replay loop against the model's own forward, in one
process, on one thread.

The full benchmark's host figure (``host ms``) is the GPU daemon's replay CPU per inference in
one cell and the NTO server's compute in another, minutes apart: on a shared machine their
speed drifts by 20 % between cells (measured here: the same eager forward, 97 ms in one process
and 126 ms in the next). This harness takes the drift out of the one question it answers -
what the replay loop (``rrtod.gpu.replay.HostReplayer`` driving the torch executor) adds to the
operators it runs - by alternating, in one process, rounds of the model's eager forward and of
its replay from a sequence definition built from the same forward's aten calls, and reporting
both and their difference per call. Nothing else is in the way: no daemon, no socket, no shim.

The definition is what the shim's recorder would send, reduced to what the host's loop sees:
every tensor the forward did not make (weights, buffers) is a CONSTANT the session holds by
id, the input is the one INPUT, uploaded with each start; every output is pushed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from bench.models import MODELS
from rrto.v1 import ops_pb2
from rrto_plugins.torch import codec
from rrto_plugins.torch.executor import TorchExecutor
from rrtod.executor import ExecutorContext
from rrtod.gpu.blobstore import BlobStore
from rrtod.gpu.replay import HostReplayer
from rrtod.wire import REPLAY_BASE, SPAN

SRC = ops_pb2.SeqSource
# The recorded inference's ids (FIRST_ID + local index, fewer than SPAN), then the constants'.
FIRST_ID = 1 << 20


class _Log(TorchDispatchMode):
    """Every aten call of one forward, with its tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict, list[torch.Tensor]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.calls.append((func, args, kwargs,
                           [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]))
        return out


class _Slot:
    """Where a bare replay (``Bare``) puts a tensor: the input, or a call's output."""

    __slots__ = ("tid",)

    def __init__(self, tid: int):
        self.tid = tid


class Bare:
    """The forward's aten calls run from a list, each output kept until the end: the
    operators alone, with as little Python around them as a loop can have."""

    def __init__(self, steps: list[tuple[Any, list[Any], dict[str, Any], list[int]]],
                 outputs: list[int]):
        self.steps, self.outputs = steps, outputs

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        env: dict[int, torch.Tensor] = {FIRST_ID: x}

        def fill(v: Any) -> Any:
            if type(v) is _Slot:
                return env[v.tid]
            if isinstance(v, (list, tuple)):
                return type(v)(fill(i) for i in v)
            return v
        for op, args, kwargs, outs in self.steps:
            result = op(*[fill(a) for a in args], **{k: fill(v) for k, v in kwargs.items()})
            tensors = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
            env.update(zip(outs, tensors, strict=False))
        return [env[i] for i in self.outputs]


def definition(model: torch.nn.Module, x: torch.Tensor
               ) -> tuple[ops_pb2.SequenceDef, dict[int, torch.Tensor], Bare]:
    """(the sequence definition of ``model(x)``, the constants it reads by id, the same
    calls as a ``Bare`` replay)."""
    log = _Log()
    with torch.inference_mode(), log:
        result = model(x)
    ids: dict[int, int] = {id(x): FIRST_ID}  # python id of a tensor -> its recorded id
    made: set[int] = {FIRST_ID}
    constants: dict[int, torch.Tensor] = {}
    d = ops_pb2.SequenceDef(id=1, local_ids=[FIRST_ID])
    seen_input = False

    def tensor_ref(t: torch.Tensor) -> ops_pb2.TensorRef:
        nonlocal seen_input
        if t is x and not seen_input:  # its first reader uploads it under its id
            seen_input = True
            d.sources.add(kind=SRC.INPUT)
            return ops_pb2.TensorRef(upload=codec.tensor_data(t), bind_id=FIRST_ID)
        tid = ids.get(id(t))
        if tid is None:  # a weight or buffer: held by the session under an id
            tid = ids[id(t)] = FIRST_ID + SPAN + len(constants)
            constants[tid] = t
        if tid in made:
            d.sources.add(kind=SRC.PRODUCED, id=tid)
        else:
            d.sources.add(kind=SRC.CONSTANT, id=tid, meta=codec.meta_of(t))
        return ops_pb2.TensorRef(id=tid)

    steps: list[tuple[Any, list[Any], dict[str, Any], list[int]]] = []

    def slot(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            tid = ids[id(v)]
            return _Slot(tid) if tid in made else v  # a constant: the tensor itself
        if isinstance(v, (list, tuple)):
            return type(v)(slot(i) for i in v)
        return v

    for func, args, kwargs, outs in log.calls:
        call = d.calls.add(op=f"{func._schema.name}.{func._overloadname}")
        for a in args:
            codec.encode_value(a, call.args.add(), tensor_ref)
        for k, v in kwargs.items():
            codec.encode_value(v, call.kwargs[k], tensor_ref)
        step = (func, [slot(a) for a in args], {k: slot(v) for k, v in kwargs.items()},
                list[int]())
        for t in outs:
            tid = ids.get(id(t))
            if tid is None or tid not in made:  # a new value (an in-place op returns its own)
                tid = ids[id(t)] = FIRST_ID + len(d.local_ids)
                d.local_ids.append(tid)
                made.add(tid)
            call.out_ids.append(tid)
            call.out_meta.append(codec.meta_of(t))
            step[3].append(tid)
        steps.append(step)
    final = [ids[id(t)] for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
    d.outputs.extend(final)
    return d, constants, Bare(steps, final)


class Harness:
    """One executor session holding the constants, and a replayer with the definition."""

    def __init__(self, d: ops_pb2.SequenceDef, constants: dict[int, torch.Tensor], tmp: str):
        ctx = ExecutorContext(device="cpu", memory_quota=1 << 40, allow_extra=(), deny=(),
                              blobs=BlobStore(f"{tmp}/blobs", 1 << 20), state_dir=tmp,
                              identity="local")
        self.executor = TorchExecutor(ctx)
        self.executor.open(ops_pb2.SessionOpen(app="hostloop", executor="torch"))
        for tid, t in constants.items():
            self.executor.store.put(tid, t)
        self.replayer = HostReplayer(self.executor)
        downs: list[ops_pb2.SessionDown] = []
        self.replayer.process(ops_pb2.SessionUp(define=d), downs.append)
        ack = downs.pop()
        if not ack.defined.accepted:
            raise SystemExit(f"the host refused the definition: {ack.defined.reason}")
        self.outputs = [list(d.local_ids).index(o) for o in d.outputs]
        self.length = len(d.calls)
        self.inference = 0

    def replay(self, x: torch.Tensor, ahead: bool = True) -> tuple[list[torch.Tensor], float]:
        """One replayed inference as the daemon's transport feeds it: the start, the input,
        and the app's release of every value but the outputs read as they arrive (the shim
        streams what its app drops while the host still computes: ``HostReplayer.read``,
        with how far the app got: an app ahead of its host, to the end; ``ahead=False``:
        nothing said, the host copies what in-place calls overwrite, for an abort);
        then the outputs, as pushed, and their release. Returns the outputs and the host's
        CPU seconds for it (the frames' encoding and the outputs' decoding are the app's)."""
        self.inference += 1
        base = REPLAY_BASE + self.inference * SPAN  # as the shim numbers them
        n = len(self.replayer.sequences[1].local)
        start = ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=1, base_id=base,
                                                           inference=base))
        arg = ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(
            slot=0, tensor=ops_pb2.TensorRef(upload=codec.tensor_data(x))))
        dropped = ops_pb2.SessionUp(release=ops_pb2.Release(
            ids=[base + i for i in range(n) if i not in self.outputs]))
        if ahead:  # the app matched it all
            dropped.release.progress.base_id, dropped.release.progress.position = base, self.length
        outputs = ops_pb2.SessionUp(release=ops_pb2.Release(
            ids=[base + i for i in self.outputs]))
        downs: list[ops_pb2.SessionDown] = []
        t0 = time.thread_time()
        self.replayer.read(start)
        self.replayer.process(start, downs.append)
        for frame in (arg, dropped):  # read while the replay is under way
            self.replayer.read(frame)
        self.replayer.process(arg, downs.append)
        self.replayer.forwarded(dropped, downs.append)
        self.replayer.forwarded(outputs, downs.append)
        host = time.thread_time() - t0
        errors = [f.error for f in downs if f.WhichOneof("msg") == "error"]
        if errors:
            raise SystemExit(f"replay failed: {errors[0]}")
        pushed = {f.fetched.id: f.fetched.tensor for f in downs
                  if f.WhichOneof("msg") == "fetched"}
        return [codec.from_tensor_data(pushed[base + i]) for i in self.outputs], host


def measure(name: str, rounds: int, per_round: int, tmp: str) -> dict[str, Any]:
    """The model's forward, its calls run bare (``Bare``) and replayed by the host's loop,
    in alternating rounds: per inference medians of this thread's CPU time."""
    spec = MODELS[name]
    model, x = spec.make(), spec.inputs(1)[0]
    d, constants, bare = definition(model, x)
    harness = Harness(d, constants, tmp)
    inputs = spec.inputs(4, seed=7)
    times: dict[str, list[float]] = {"forward": [], "bare": [], "replayed": []}

    def timed(run: Any) -> Any:
        def once(t: torch.Tensor) -> float:
            t0 = time.thread_time()
            run(t)
            return time.thread_time() - t0
        return once

    runs: dict[str, Any] = {"forward": timed(model), "bare": timed(bare),
                            "replayed": lambda t: harness.replay(t)[1]}
    with torch.inference_mode():
        for t in inputs:  # outputs equal the model's own, bit for bit, or nothing is reported
            want = [o for o in tree_flatten(model(t))[0] if isinstance(o, torch.Tensor)]
            for got in (harness.replay(t)[0], bare(t)):
                if not all(torch.equal(a, b) for a, b in zip(want, got, strict=True)):
                    raise SystemExit(f"{name}: replayed outputs differ from the forward's")
        order = list(runs)
        for r in range(rounds):
            for which in order[r % 3:] + order[:r % 3]:
                for i in range(per_round):
                    times[which].append(runs[which](inputs[i % len(inputs)]))
    f, b, p = (statistics.median(times[k]) for k in ("forward", "bare", "replayed"))
    return {"model": name, "calls": len(d.calls), "forward_ms": f * 1e3, "bare_ms": b * 1e3,
            "replayed_ms": p * 1e3, "replayed_over_forward": p / f,
            "loop_us_per_call": (p - b) / len(d.calls) * 1e6}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hostloop", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,resnet18,yolo-pose")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--per-round", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="one JSON object per model")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            row = measure(name, args.rounds, args.per_round, tmp)
            if args.json:
                print(json.dumps(row))
            else:
                print(f"{row['model']:>12}: {row['calls']:5d} calls; forward "
                      f"{row['forward_ms']:8.2f} ms, bare {row['bare_ms']:8.2f} ms, replayed "
                      f"{row['replayed_ms']:8.2f} ms (x{row['replayed_over_forward']:.3f} the "
                      f"forward); the loop adds {row['loop_us_per_call']:5.1f} us a call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
