"""A lost GPU host costs the app no error (plugins/torch/journal.py, reconnect.py): the open
inference's values are rebuilt here from the journal, later inferences run here, and the
session goes back to offloading once a host takes it again. Never a wrong value: what cannot
be rebuilt raises ``HostLost`` as before. Every result is compared with local execution."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from rrto.v1 import ops_pb2
from rrto_plugins.torch.errors import HostLost, RemoteOpError
from rrto_plugins.torch.proxy import RemoteTensor
from rrto_plugins.torch.testing import loopback


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)).eval()


@contextlib.contextmanager
def offloaded(tmp_path, **kw: Any) -> Iterator[Any]:
    """An installed loopback interceptor (``plugins/torch/testing.py``), uninstalled after."""
    itc = loopback(tmp_path, **kw)
    try:
        yield itc
    finally:
        itc.uninstall()


def lose(itc: Any, why: str = "GPU host vanished") -> None:
    itc.session.channel.lose(why)


class LoseMidway(nn.Module):
    """Loses the host in the middle of the forward, then keeps computing on the proxies made
    before (one call waits for the host: ``nonzero``'s size follows the data)."""

    def __init__(self, lose) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.lose = lose

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).relu()
        if self.lose is not None:
            self.lose()
        keep = (h > 0.1).nonzero()
        return self.b(h) + keep.shape[0]


def test_the_open_inference_is_rebuilt_here_when_the_host_is_lost(tmp_path):
    m, x = mlp(), torch.randn(2, 8)
    with torch.no_grad():
        ref = m(x)
    with offloaded(tmp_path) as itc:
        with torch.no_grad():
            y = m(x)
            z = y.softmax(-1)  # computed on the host after the module returned
        assert isinstance(z, RemoteTensor)
        lose(itc)
        assert torch.equal(y.cpu(), ref)
        assert torch.equal(z.cpu(), ref.softmax(-1))
        with torch.no_grad():  # later inferences run here, on the app's copies of the weights
            again = m(x)
        assert type(again) is torch.Tensor and torch.equal(again, ref)
        c = itc.session.counters
        assert c["hosts_lost"] == 1 and c["recoveries"] == 1 and c["rebuilt_reads"] == 2


def test_a_host_lost_in_the_middle_of_a_forward_is_no_error(tmp_path):
    x = torch.randn(3, 8)
    with torch.no_grad():
        ref = LoseMidway(None)(x)
    with offloaded(tmp_path) as itc:
        m = LoseMidway(lambda: lose(itc))
        with torch.no_grad():
            y = m(x)
        assert type(y) is torch.Tensor and torch.equal(y, ref)


def test_a_value_from_before_the_kept_window_raises_never_a_wrong_value(tmp_path):
    m, x = mlp(), torch.randn(2, 8)
    with offloaded(tmp_path) as itc:
        with torch.no_grad():
            old = m(x) * 2
            for _ in range(3):  # the journal keeps this inference and the one before
                m(x).cpu()
        lose(itc)
        with pytest.raises(HostLost, match="lived on the GPU host"):
            old.cpu()


def test_a_value_kept_from_the_previous_inference_is_rebuilt(tmp_path):
    m, x0, x1 = mlp(), torch.randn(2, 8), torch.randn(2, 8)
    with torch.no_grad():
        ref0, ref1 = m(x0), m(x1)
    with offloaded(tmp_path) as itc:
        with torch.no_grad():
            last = m(x0)  # a tracker's previous result, read after the next inference
            now = m(x1)
        lose(itc)
        assert torch.equal(now.cpu(), ref1) and torch.equal(last.cpu(), ref0)


def test_an_input_changed_in_place_since_it_was_sent_is_not_trusted(tmp_path):
    m, frame = mlp(), torch.randn(2, 8)
    with offloaded(tmp_path) as itc:
        with torch.no_grad():
            y = m(frame)
            frame.add_(1.0)  # a reused frame buffer, already holding the next frame
        lose(itc)
        with pytest.raises(HostLost):
            y.cpu()


def test_fallback_error_raises_host_lost(tmp_path):
    m, x = mlp(), torch.randn(2, 8)
    with offloaded(tmp_path, fallback="error") as itc:
        with torch.no_grad():
            y = m(x)
        lose(itc)
        with pytest.raises(HostLost, match="GPU host vanished"):
            y.cpu()


def _stuck(itc) -> str:
    """Why no host took the session: the reconnect's state and every thread's stack."""
    import sys
    import threading
    import traceback
    r = itc.session._reconnect
    names = {t.ident: t.name for t in threading.enumerate()}
    stacks = "\n".join(f"--- {names.get(i, i)}\n" + "".join(traceback.format_stack(f))
                       for i, f in sys._current_frames().items())
    return (f"last_error={r.last_error!r} busy={r._busy} ready={r._ready is not None} "
            f"next_in={r._next - time.monotonic():.1f}s lost={itc.session.lost!r}\n{stacks}")


def _until_offloading(itc, m: nn.Module, x: torch.Tensor, ref: torch.Tensor) -> int:
    """Infer until a new host took the session; every result must equal ``ref``. (A liveness
    bound, not a timing: 30 s was once exceeded with the suite on two workers.)"""
    deadline = time.monotonic() + 90
    n, before = 0, itc.session.counters["reconnects"]
    while itc.session.counters["reconnects"] == before:
        assert time.monotonic() < deadline, _stuck(itc)
        with torch.no_grad():
            y = m(x)
        assert torch.equal(y.cpu() if isinstance(y, RemoteTensor) else y, ref)
        n += 1
        time.sleep(0.01)
    return n


def test_the_session_goes_back_to_offloading_on_a_new_host(tmp_path):
    """A new host with an empty weight cache takes the session: the weights are offered and
    uploaded in the background, then inferences are offloaded again; a proxy of the lost
    host the app still holds is sent as its rebuilt value."""
    m, x = mlp(), torch.randn(2, 8)
    with torch.no_grad():
        ref = m(x)
    with offloaded(tmp_path, takeover=True) as itc:
        with torch.no_grad():
            kept = m(x)
        first = itc.session.channel.executor
        lose(itc)
        _until_offloading(itc, m, x, ref)
        s = itc.session
        assert s.channel.executor is not first and s.lost is None and s.epoch == 1
        calls = s.counters["calls"]
        with torch.no_grad():
            y = m(x)
            both = y + kept  # ``kept`` is of the lost host: its rebuilt value is uploaded
        assert isinstance(y, RemoteTensor) and s.counters["calls"] > calls
        assert torch.equal(y.cpu(), ref) and torch.equal(both.cpu(), ref + ref)
        assert s.counters["blob_bytes_up"] > 0  # the new host had none of the weights
        # and it can be lost again, and taken over again
        s.channel.lose("second host vanished")
        assert torch.equal(y.cpu(), ref)
        _until_offloading(itc, m, x, ref)
        assert s.epoch == 2


def test_a_weight_only_the_lost_host_had_keeps_the_session_local(tmp_path):
    """A weight written on the host (``fill_``) has no value here after the loss: using it
    raises, and the session never offers the new host a stale copy."""
    m, x = mlp(), torch.randn(2, 8)
    with offloaded(tmp_path, takeover=True) as itc:
        with torch.no_grad():
            m(x).cpu()
            m[2].bias.fill_(0.25)
            for _ in range(3):
                m(x).cpu()
            lose(itc)
            for _ in range(3):
                with pytest.raises(HostLost, match="lived on the GPU host"):
                    m(x)
                time.sleep(0.05)
        assert itc.session.counters["reconnects"] == 0
        assert "only value" in (itc.session._reconnect.last_error or "")


def test_the_new_host_frees_what_the_app_drops_while_old_values_are_kept(tmp_path):
    """With rebuilt values of the lost host still held, the new host is still told of every
    proxy the app drops: its tensors do not pile up from one inference to the next."""
    m, x = mlp(), torch.randn(2, 8)
    with offloaded(tmp_path, takeover=True) as itc:
        with torch.no_grad():
            kept = m(x)
        lose(itc)
        assert torch.equal(kept.cpu(), m(x))  # rebuilt: kept stays in ``recovered``
        _until_offloading(itc, m, x, m(x))
        live = []
        for _ in range(6):
            with torch.no_grad():
                m(x).cpu()
            live.append(itc.session.channel.executor.stats()["tensors"])
        assert live[-1] == live[2], live
        assert itc.session.recovered  # and the old value is still there


class Stallable:
    """A host that can stall: frames are held (not lost) until ``resume``."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.session, self.host, self.device = inner.session, inner.host, inner.device
        self.executor = inner.executor
        self.held: list = []
        self.stalled = False

    def start(self, on_down, on_lost) -> None:
        self.inner.start(on_down, on_lost)

    def send(self, frames) -> None:
        if self.stalled:
            self.held.append(list(frames))
        else:
            self.inner.send(frames)

    def resume(self) -> None:
        self.stalled = False
        held, self.held = self.held, []
        for frames in held:
            self.inner.send(frames)

    def mark(self, *a, **kw) -> None:
        self.inner.mark(*a, **kw)

    def flush_marks(self) -> None:
        pass

    def close(self) -> None:
        self.inner.close()

    def reopen(self):
        return self.inner.reopen()


class Nonzero(nn.Module):
    """A head whose output size follows the data (its call waits for the host's answer)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h[h > 0] * 2


def test_an_inference_past_its_deadline_is_finished_here_and_the_next_is_offloaded(tmp_path):
    m, x = mlp(), torch.randn(2, 8)
    with torch.no_grad():
        ref = m(x)
    with offloaded(tmp_path, channel=Stallable, deadline_ms=50) as itc:
        ch, s = itc.session.channel, itc.session
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(m(x).cpu(), ref)
            ch.stalled = True
            t0 = time.monotonic()
            y = m(x)
            assert isinstance(y, RemoteTensor) and torch.equal(y.cpu(), ref)
            waited = time.monotonic() - t0
            assert s.counters["deadline_misses"] == 1 and waited < 30
            y.add_(1.0)  # written here, after the deadline: the host's copy is older now
            ch.resume()  # the late replies arrive, and are dropped
            calls = s.counters["calls"]
            z = m(x)
            both = z + y  # y is sent as its value here
            assert isinstance(z, RemoteTensor) and s.counters["calls"] > calls
            # (as the app adds them: ``ref + (ref + 1)`` rounds otherwise than ``ref + ref + 1``)
            assert torch.equal(z.cpu(), ref) and torch.equal(both.cpu(), ref + (ref + 1))
            assert s.counters["deadline_misses"] == 1 and s.lost is None


def test_a_late_answer_with_host_made_outputs_is_released(tmp_path):
    m, x = Nonzero().eval(), torch.randn(4, 8)
    with torch.no_grad():
        ref = m(x)
    with offloaded(tmp_path, channel=Stallable, deadline_ms=50) as itc:
        ch, s = itc.session.channel, itc.session
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(m(x).cpu(), ref)
            base = ch.executor.stats()["tensors"]
            ch.stalled = True
            assert torch.equal(m(x), ref)  # the size-following call waited past the deadline
            assert s.counters["deadline_misses"] == 1
            ch.resume()
            for _ in range(3):
                assert torch.equal(m(x).cpu(), ref)
        assert ch.executor.stats()["tensors"] == base


def test_the_deadline_comes_from_the_config_or_rrto_deadline_ms(tmp_path, monkeypatch):
    from rrtod.shim.activate import settings

    cfg = tmp_path / "rrtod.yaml"
    cfg.write_text("intercept: {deadline_ms: 250}\n")
    monkeypatch.setenv("RRTO_CONFIG", str(cfg))
    monkeypatch.delenv("RRTO_DEADLINE_MS", raising=False)
    assert settings().deadline_ms == 250
    monkeypatch.setenv("RRTO_DEADLINE_MS", "40")
    assert settings().deadline_ms == 40
    monkeypatch.setenv("RRTO_DEADLINE_MS", "0")  # none, whatever the config says
    assert settings().deadline_ms is None
    monkeypatch.setenv("RRTO_DEADLINE_MS", "soon")
    s = settings()
    assert s.deadline_ms == 250 and "RRTO_DEADLINE_MS='soon'" in s.config_note
    monkeypatch.setenv("RRTO_DEADLINE_MS", "-5")
    assert settings().deadline_ms == 250


def test_inputs_made_under_inference_mode_are_kept_as_copies(tmp_path):
    """An inference tensor has no version counter: the journal keeps a copy of it, so a frame
    buffer reused under ``inference_mode`` is still rebuilt from what was sent."""
    m = mlp()
    with torch.inference_mode():
        frame = torch.randn(2, 8)
        ref = m(frame)
    with offloaded(tmp_path) as itc:
        with torch.inference_mode():
            y = m(frame)
            sent = frame.clone()
            frame.add_(1.0)  # the next frame, in the same buffer
        lose(itc)
        assert torch.equal(y.cpu(), ref) and not torch.equal(frame, sent)


def test_an_inference_the_host_could_not_replay_is_finished_here(tmp_path):
    """What the replay client asks when the host refused or failed a replay without saying
    where (``ReplayClient.failed``: its matched calls may have made nothing there): the open
    inference's values are rebuilt here and read as local ones, the rest of it runs here, and
    the next inference is offloaded again. The host's error names the sequence: it is the
    replay's, never raised in the app; a crash of the host's handling may be a forwarded
    call's, and is."""
    m, x = mlp(), torch.randn(2, 8)
    with torch.no_grad():
        ref = m(x)
    with offloaded(tmp_path) as itc:
        s = itc.session
        with torch.no_grad():
            y = m(x)
            assert isinstance(y, RemoteTensor)
            s._on_down(ops_pb2.SessionDown(error=ops_pb2.Error(
                code="UNKNOWN_SEQUENCE", message="no sequence 5 defined", sequence=5)))
            s.raise_async_errors()  # nothing for the app
            assert s.finish_here("replay") and s.is_late()
            z = y.softmax(-1)
            assert type(z) is torch.Tensor and torch.equal(z, ref.softmax(-1))
            assert torch.equal(y.cpu(), ref)
            assert s.counters["finished_here"] == 1 and s.counters["deadline_misses"] == 0
            calls = s.counters["calls"]
            again = m(x)
            assert isinstance(again, RemoteTensor) and s.counters["calls"] > calls
            assert torch.equal(again.cpu(), ref) and not s.is_late()
        s._on_down(ops_pb2.SessionDown(error=ops_pb2.Error(
            code="INTERNAL", message="boom", sequence=5)))
        with pytest.raises(RemoteOpError, match="boom"):
            s.raise_async_errors()
    with offloaded(tmp_path / "strict", fallback="error") as itc, torch.no_grad():
        m(x)
        assert not itc.session.finish_here("replay")  # nothing may run here


class LostOnUpload(Stallable):
    """A host lost as the app uploads its second weight (a slow link's first upload of a
    model's weights, behind which the robot daemon's pings went unanswered)."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.blobs = 0

    def send(self, frames) -> None:
        self.blobs += sum(f.WhichOneof("msg") == "blob" for f in frames)
        if self.blobs >= 2 and not self.inner.lost:
            self.inner.lose("no answer to 2 pings in 2.0 s")
        self.inner.send(frames)


@pytest.mark.parametrize("fallback", ["local", "error"])
def test_a_host_lost_while_the_weights_go_up_is_no_error(fallback, tmp_path):
    """The first forward offers and uploads the module's weights; the host is lost in the
    middle. Under ``fallback: local`` the weights stay the app's own (their proxies keep them)
    and the forward runs here, equal to local; under ``fallback: error`` the app is told."""
    m, x = mlp(), torch.randn(2, 8)
    with torch.no_grad():
        ref = m(x)
    with offloaded(tmp_path, channel=LostOnUpload, fallback=fallback) as itc:
        if fallback == "error":
            with pytest.raises(HostLost, match="no answer to 2 pings"), torch.no_grad():
                m(x)
            return
        with torch.no_grad():
            y, again = m(x), m(x)
        assert itc.session.channel.blobs >= 2 and itc.session.lost is not None
        assert type(y) is torch.Tensor and torch.equal(y, ref) and torch.equal(again, ref)
