"""A third-party-style plugin used by the daemon tests: an ``echo`` interception backend whose
host executor needs no framework. It counts calls, acknowledges ``sync`` calls, answers fetches
with a tensor whose bytes encode the fetched id (or, past ``LARGE``, as many bytes as it says),
and fails an op named ``test::boom`` — enough
to check the relay's ordering, error paths and accounting without torch."""

from __future__ import annotations

import struct

from rrto.v1 import ops_pb2
from rrtod.hookspecs import InterceptionBackend, PluginRecord, hookimpl

# A fetch of an id in [LARGE, LARGE + 2**32) is answered with ``id - LARGE`` zero bytes: a large
# reply. (Among the ids an app allocates, far above those a test counts up to, below replays'.)
LARGE = 1 << 48


class EchoExecutor:
    replay = None  # no replay extension (rrtod.executor): sequences replay through handle
    reply_memory = None  # queued replies are not counted

    def __init__(self, ctx):
        self.ctx = ctx
        self.ops = 0

    def open(self, request):
        return ops_pb2.SessionReady(device="echo")

    def handle(self, frame):
        kind = frame.WhichOneof("msg")
        if kind == "call":
            self.ops += 1
            if frame.call.op == "test::boom":
                yield ops_pb2.SessionDown(error=ops_pb2.Error(
                    code="OP_FAILED", message="boom", seq=frame.call.seq))
            elif frame.call.sync:
                yield ops_pb2.SessionDown(result=ops_pb2.OpResult(seq=frame.call.seq))
        elif kind == "fetch" and LARGE <= frame.fetch.id < LARGE + (1 << 32):
            n = frame.fetch.id - LARGE  # a large reply: that many bytes
            meta = ops_pb2.TensorMeta(dtype="uint8", shape=[n], stride=[1], device="cpu")
            yield ops_pb2.SessionDown(fetched=ops_pb2.Fetched(
                seq=frame.fetch.seq, tensor=ops_pb2.TensorData(meta=meta, data=bytes(n))))
        elif kind == "fetch":
            data = struct.pack("<q", frame.fetch.id)
            meta = ops_pb2.TensorMeta(dtype="int64", shape=[1], stride=[1], device="cpu")
            yield ops_pb2.SessionDown(fetched=ops_pb2.Fetched(
                seq=frame.fetch.seq, tensor=ops_pb2.TensorData(meta=meta, data=data)))

    def stats(self):
        # What the daemon granted this session, so tests can see the access rules at work.
        return {"ops": self.ops, "bytes_live": 0, "memory_quota": self.ctx.memory_quota,
                "allow_extra": list(self.ctx.allow_extra), "ctx_identity": self.ctx.identity}

    def close(self):
        pass


@hookimpl
def rrto_interception_backends():
    return [InterceptionBackend(name="echo", factory=lambda client: None, executor=EchoExecutor,
                                description="test backend: echoes, no framework")]


class AlternateGroups:
    """A test scheduler that cuts as often as it can: every other movable group of calls on
    the robot, so that values cross the link both ways many times in one inference."""

    def place(self, sequence, link=None):
        order = []
        for call in sequence.calls:
            if call.movable and call.group not in order:
                order.append(call.group)
        robot = set(order[::2])
        return ["robot" if c.group in robot else "host" for c in sequence.calls]


class SplitRegion:
    """A test scheduler that splits by rows (Hybrid-Parallel's mechanism, ``rrtod.lop``)
    without measuring: the largest split region, the robot making 40 % of the rows at its
    edge, every other call on the host."""

    parallel = True

    def place(self, sequence, link=None):
        import os

        from rrtod.partition import HOST, SPLIT, Hybrid

        regions = sequence.space.regions() if sequence.space is not None else []
        if not regions:
            return [HOST] * len(sequence.calls)
        # RRTO_TEST_SPLIT="region index,share" picks another split (a test's sweep)
        which, at = os.environ.get("RRTO_TEST_SPLIT", "-1,0.4").split(",")
        inside = set(regions[int(which)].calls)
        return Hybrid([SPLIT if k in inside else HOST for k in range(len(sequence.calls))],
                      float(at))


class BrokenScheduler:
    """A test scheduler that fails: the daemon must replay the sequence on the host whole."""

    def place(self, sequence, link=None):
        raise RuntimeError("this scheduler always fails")


@hookimpl
def rrto_schedulers():
    return [PluginRecord("test-alternate", AlternateGroups, "test: every other group on the robot"),
            PluginRecord("test-split", SplitRegion, "test: the largest split region, by rows"),
            PluginRecord("test-broken", BrokenScheduler, "test: raises")]
