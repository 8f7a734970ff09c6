"""The client interceptor against an in-process executor (loopback): proxies, data reads,
grad modes, threads, modes, errors, persistent tensors. Real daemons: test_torch_apps.py."""

from __future__ import annotations

import io
import pickle
import threading
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from rrto_plugins.torch.errors import HostLost, RemoteOpError
from rrto_plugins.torch.proxy import RemoteTensor
from rrto_plugins.torch.testing import loopback


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)).eval()


@pytest.fixture(params=["stream", "sync"])
def offload(request, tmp_path):
    made = []

    def start(**kw):
        itc = loopback(tmp_path, mode=kw.pop("mode", request.param), **kw)
        made.append(itc)
        return itc
    yield start
    for itc in made:
        itc.uninstall()


def host(itc):
    return itc.session.channel.executor


def test_forward_is_offloaded_and_bitwise_equal(offload):
    m, x = mlp(), torch.randn(5, 8)
    with torch.no_grad():
        ref = m(x)
    itc = offload()
    with torch.no_grad():
        y = m(x)
    assert isinstance(y, RemoteTensor) and y.shape == ref.shape and y.dtype == ref.dtype
    assert isinstance(m[0].weight, nn.Parameter) and isinstance(m[0].weight, RemoteTensor)
    assert torch.equal(y.cpu(), ref)
    assert host(itc).stats()["ops"] >= 3
    assert len(itc.session.channel.marks) == 1  # one top-level module call = one inference


@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode, torch.enable_grad])
def test_grad_modes(offload, ctx):
    m, x = mlp(), torch.randn(2, 8)
    with ctx():
        ref = m(x)
    offload()
    with ctx():
        y = m(x)
    assert y.requires_grad == ref.requires_grad
    assert torch.equal(y.detach().cpu(), ref.detach())


def test_data_reads_download(offload):
    m, x = mlp(), torch.randn(3, 8)
    with torch.no_grad():
        ref = m(x)
    offload()
    with torch.no_grad():
        y = m(x)
    assert y.tolist() == ref.tolist()
    assert np.array_equal(y.numpy(), ref.numpy()) and np.array_equal(np.asarray(y), ref.numpy())
    assert y[0, 0].item() == ref[0, 0].item()
    assert bool(y.sum() > 0) == bool(ref.sum() > 0)
    assert float(y[1, 1]) == float(ref[1, 1]) and int(y.argmax()) == int(ref.argmax())
    assert repr(y) == repr(ref) and f"{y.sum():.4f}" == f"{ref.sum():.4f}"
    assert torch.equal(pickle.loads(pickle.dumps(y)), ref)
    buf = io.BytesIO()
    torch.save(y, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf), ref)
    assert y.data_ptr() != 0 and y.untyped_storage().nbytes() == ref.numel() * 4
    assert torch.equal(y.to("cpu"), ref) and type(y.cpu()) is torch.Tensor


def test_local_preprocessing_stays_local_and_mixed_args_upload(offload):
    itc = offload()
    a = torch.randn(4)
    b = a * 2 + 1  # no proxy involved: plain local torch
    assert type(b) is torch.Tensor and host(itc).stats()["ops"] == 0


def test_data_dependent_shapes(offload):
    m = mlp()
    offload()
    with torch.no_grad():
        y = m(torch.randn(6, 8))
    ref = y.cpu()
    assert torch.equal(y[y > 0].cpu(), ref[ref > 0])
    assert torch.equal(torch.nonzero(y > 0).cpu(), torch.nonzero(ref > 0))
    u, inv = torch.unique((y > 0).int(), return_inverse=True)
    assert torch.equal(u.cpu(), torch.unique((ref > 0).int()))


def test_inplace_views_and_multi_output(offload):
    m = mlp()
    offload()
    with torch.no_grad():
        y = m(torch.randn(4, 8))
    ref = y.cpu().clone()
    z = y.view(2, 8)
    z.add_(1.0)  # in place on a view: visible through the base, as locally
    ref.view(2, 8).add_(1.0)
    assert torch.equal(y.cpu(), ref)
    vals, idx = torch.topk(y, 2, dim=1)
    rv, ri = torch.topk(ref, 2, dim=1)
    assert torch.equal(vals.cpu(), rv) and torch.equal(idx.cpu(), ri)
    parts = y.split(1, dim=0)
    assert len(parts) == 4 and torch.equal(parts[3].cpu(), ref[3:4])
    local = torch.zeros(4, 4)
    local.copy_(y)  # a local destination: computed locally from a download
    assert type(local) is torch.Tensor and torch.equal(local, ref)


def test_threads_share_the_session(offload):
    m = mlp()
    xs = [torch.randn(2, 8) for _ in range(4)]
    with torch.no_grad():
        refs = [m(x) for x in xs]
    offload()
    out: dict[int, torch.Tensor] = {}

    def run(i: int) -> None:
        with torch.no_grad():
            for _ in range(5):
                out[i] = m(xs[i]).cpu()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(out[i], refs[i]) for i in range(4))


def test_releases_free_host_memory(offload):
    m = mlp()
    itc = offload()

    def live_after(n: int) -> int:
        with torch.no_grad():
            for _ in range(n):
                m(torch.randn(64, 8)).sum().item()
        itc.session.flush()
        return host(itc).stats()["bytes_live"]
    settled = live_after(2)
    assert live_after(20) <= settled  # dropped proxies are released: no growth
    assert host(itc).stats()["bytes_peak"] < 20 * 64 * 32 * 4


def test_persistent_tensors_uploaded_once_across_sessions(tmp_path):
    from rrtod.gpu.blobstore import BlobStore
    blobs = BlobStore(tmp_path / "blobs", 1 << 30)
    m = mlp()
    first = loopback(tmp_path, blobs=blobs)
    with torch.no_grad():
        m(torch.randn(1, 8)).cpu()
    first.uninstall()
    weights = sum(p.numel() * 4 for p in m.parameters())
    assert first.session.counters["blob_bytes_up"] == weights
    m2 = mlp()  # a restarted app: same weights, fresh objects
    second = loopback(tmp_path, blobs=blobs)
    with torch.no_grad():
        m2(torch.randn(1, 8)).cpu()
    second.uninstall()
    assert second.session.counters["blob_bytes_up"] == 0


def test_refused_op_raises_clearly_or_runs_locally(offload, capfd):
    m = mlp()
    itc = offload(deny=("aten::relu",), fallback="error")
    with pytest.raises(RemoteOpError, match="aten::relu.default is denied"):
        with torch.no_grad():
            m(torch.randn(2, 8))
    itc.uninstall()
    m2, x = mlp(), torch.randn(2, 8)
    with torch.no_grad():
        ref = m2(x)
    capfd.readouterr()
    itc = offload(deny=("aten::relu",), fallback="local")
    with torch.no_grad():
        y = m2(x)
        m2(x)
    assert torch.equal(y.cpu(), ref) and itc.session.counters["local_ops"] == 2
    warned = [line for line in capfd.readouterr().err.splitlines() if "runs locally" in line]
    # one line, however often the operator runs, naming it and why
    assert warned == ["rrto: warning: aten::relu.default runs locally (on this machine), not on "
                      "the GPU host: the GPU host refuses it (rrto OP_NOT_ALLOWED: operator "
                      "aten::relu.default is denied on this host)"], warned


def test_async_error_surfaces_at_next_download(tmp_path):
    m = mlp()
    itc = loopback(tmp_path, mode="stream")
    try:
        with torch.no_grad():
            y = m(torch.randn(2, 8))
            (y @ torch.ones(4, 2)).cpu()  # the first call of an operator waits (probe)
            host(itc).store.quota = host(itc).store.bytes_live  # nothing more fits
            z = y @ torch.ones(4, 1000)  # streamed: accepted now, refused by the host
            with pytest.raises(RemoteOpError, match="QUOTA_EXCEEDED"):
                z.cpu()
    finally:
        itc.uninstall()


def _child(m: nn.Module, x: torch.Tensor, q: Any) -> None:
    torch.set_num_threads(1)  # GNU OpenMP hangs in a forked child otherwise (plain torch too)
    with torch.no_grad():
        y = m(x)
    q.put((type(y).__name__, y.tolist()))


def test_forked_child_runs_locally_without_touching_the_connection(tmp_path):
    import multiprocessing

    m, x = mlp(), torch.randn(2, 8)
    with torch.no_grad():
        ref = m(x)
    itc = loopback(tmp_path)
    try:
        with torch.no_grad():
            assert torch.equal(m(x).cpu(), ref)
        frames = itc.session.counters["frames"]
        ctx = multiprocessing.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=_child, args=(m, x, q))
        p.start()
        kind, values = q.get(timeout=60)
        p.join(60)
        assert kind == "Tensor" and values == ref.tolist()
        with torch.no_grad():  # the parent's session is untouched
            assert torch.equal(m(x).cpu(), ref)
        assert itc.session.counters["frames"] > frames
    finally:
        itc.uninstall()


def test_a_forked_child_computes_with_weights_edited_after_offloading_started(tmp_path):
    """The child computes locally with the app's copies of the weights: a weight edited in
    place on the host (load_state_dict, fusion, an EMA step) is fetched before the fork, not
    left at its old value."""
    import multiprocessing

    m, x = mlp(), torch.randn(2, 8)
    itc = loopback(tmp_path)
    try:
        with torch.no_grad():
            m(x).cpu()  # offloading started
            m[0].weight.mul_(0.5)
            m[2].bias.fill_(0.25)
            want = m(x).cpu()
        ctx = multiprocessing.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=_child, args=(m, x, q))
        p.start()
        kind, values = q.get(timeout=60)
        p.join(60)
        assert kind == "Tensor" and values == want.tolist()
    finally:
        itc.uninstall()


def test_a_lost_host_never_computes_with_a_weight_older_than_the_hosts(tmp_path):
    """After the host is lost, inferences run on the app's copies of the weights; a weight
    edited on the host since is not there, so its use raises instead of a wrong result."""
    m, x = mlp(), torch.randn(2, 8)
    itc = loopback(tmp_path, fallback="local")
    try:
        with torch.no_grad():
            m(x).cpu()
            m[2].bias.fill_(0.25)
            itc.session.channel.lose("GPU host vanished")
            with pytest.raises(HostLost, match="lived on the GPU host"):
                m(x)
    finally:
        itc.uninstall()


def test_session_implements_the_interface_its_parts_use(tmp_path):
    """Proxies, replay, downloads and fallback see the session only as ``session_api.Session``
    (so they need not import client.py): every member it declares is there, callables too."""
    from rrto_plugins.torch.session_api import Session

    itc = loopback(tmp_path)
    try:
        session = itc.session
        declared = set(Session.__annotations__) | {
            n for n, v in vars(Session).items() if callable(v) and not n.startswith("_")}
        assert {"submit", "send_frames", "bind", "download", "dispatch", "released"} <= declared
        missing = [n for n in declared if not hasattr(session, n)]
        assert missing == []
        not_callable = [n for n, v in vars(Session).items() if callable(v)
                        and not n.startswith("_") and not callable(getattr(session, n))]
        assert not_callable == []
    finally:
        itc.uninstall()


def test_to_cpu_reads_in_the_app_and_keeps_the_proxy_in_a_forward(offload):
    """``.to("cpu")`` in the app's own code asks for the data (a real tensor, a round trip);
    in a model's forward it keeps a tensor on its input's device (RAFT's ``grid.to(x.device)``,
    a proxy's device reading "cpu"): the proxy goes on, with no more round trips than the same
    forward without ``.to``, and the same values."""

    class Grid(nn.Module):
        def __init__(self, to: bool) -> None:
            super().__init__()
            self.to_device = to

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            grid = torch.arange(8.0)  # made on the host (factories.py)
            if self.to_device:
                grid = grid.to(x.device)
            return (x + grid) * 2

    x = torch.randn(3, 8)
    with torch.no_grad():
        ref = Grid(True)(x)
    itc = offload()
    trips = {}
    with torch.no_grad():
        for to in (False, True):
            model = Grid(to)
            model(x)  # the first call sets the session up
            before = itc.session.counters["round_trips"]
            y = model(x)
            trips[to] = itc.session.counters["round_trips"] - before
            assert isinstance(y, RemoteTensor)
        before = itc.session.counters["round_trips"]
        out = y.to("cpu")
    assert trips[True] == trips[False], trips
    assert type(out) is torch.Tensor and torch.equal(out, ref)
    assert itc.session.counters["round_trips"] > before


def test_a_tensor_of_python_numbers_made_for_the_models_device_is_made_on_the_host(offload):
    """torchvision's detection transform: ``torch.as_tensor(mean, device=image.device)`` in a
    forward. Made in the app, the normalisation and the resize after it ran in the app, and the
    enlarged image was uploaded; now the app's input is uploaded as it is and everything after
    runs on the host. A tensor made without a device (``torch.tensor(image.shape[-2:])``) is
    read back at once: it stays in the app, and its reads cost no round trip."""
    seen: dict[str, Any] = {}

    class Normalize(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, image: torch.Tensor) -> torch.Tensor:
            mean = torch.as_tensor([0.5, 0.25, 0.75], dtype=image.dtype, device=image.device)
            std = torch.tensor([0.5, 0.5, 2.0], device=image.device)
            scale = 4.0 / float(torch.tensor(image.shape[-2:]).min().item())
            seen.update(mean=mean, std=std)
            image = (image - mean[:, None, None]) / std[:, None, None]
            image = nn.functional.interpolate(image[None], scale_factor=scale, mode="bilinear")
            return self.conv(image)

    torch.manual_seed(0)
    model, x = Normalize().eval(), torch.rand(3, 8, 8)
    with torch.no_grad():
        ref = model(x)
    assert type(seen["mean"]) is torch.Tensor  # not offloaded: plain local execution
    itc = offload()
    with torch.no_grad():
        model(x)  # the first call sets the session up
        before = dict(itc.session.counters)
        y = model(x)
        after = dict(itc.session.counters)
    assert isinstance(seen["mean"], RemoteTensor) and isinstance(seen["std"], RemoteTensor)
    assert torch.equal(seen["mean"].cpu(), torch.tensor([0.5, 0.25, 0.75]))
    assert torch.equal(y.cpu(), ref)
    # the input as it is (768 bytes) and the two constants: not the 32x32 image (12 KB)
    assert after["bytes_up"] - before["bytes_up"] < 3 * 8 * 8 * 4 + 256
    if itc.session.mode == "stream":  # the forward itself waits for nothing
        assert after["round_trips"] == before["round_trips"]
    # a tensor of Python numbers outside a forward, or of something else, stays local
    assert type(torch.as_tensor([1.0, 2.0], device=x.device)) is torch.Tensor
    with torch.no_grad():
        model.forward = lambda image: torch.as_tensor(np.zeros(3), device=image.device)
        assert type(model(x)) is torch.Tensor


def test_a_tensor_read_back_mid_model_keeps_its_layout_on_the_host(tmp_path):
    """hf-clip's ``text @ image.t().to(text.device)``. Before ``.to`` in a forward kept the
    proxy, the transposed operand was downloaded and uploaded again, and the host must rebuild
    such an upload with the app's strides (``(1, 32)``, not the canonical ``(1, 1)`` of a
    C-contiguous ``[32, 1]``): the CPU matmul picks its kernel by strides, and the logits
    differed in the last bit. Now the host computes it from its own view; equal either way."""

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 32), nn.Linear(16, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a, b = self.a(x[:1]), self.b(x[1:])
            a, b = a / a.norm(dim=-1, keepdim=True), b / b.norm(dim=-1, keepdim=True)
            return a @ b.t().to(a.device)

    torch.manual_seed(0)
    model, xs = Logits().eval(), [torch.randn(2, 16) for _ in range(16)]
    with torch.no_grad():
        want = [model(x) for x in xs]
        itc = loopback(tmp_path)
        try:
            got = [model(x).cpu() for x in xs]
            assert itc.session.counters["calls"] > 0
        finally:
            itc.uninstall()
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_a_convolution_of_a_channels_last_input_stays_channels_last_on_the_host(offload):
    """timm's ConvNeXt-V2: ``LayerNorm2d`` permutes to NHWC and back, so the depthwise conv gets
    a channels-last input, and the CPU kernel returns a channels-last result. The meta kernel
    answers C-contiguous; the proxy said so and the host copied its result into that layout,
    and GELU after it rounds by layout (outputs differed from local by ~3e-7). The proxy must
    describe the device kernel's layout."""
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 8, 7, padding=3, groups=8).eval()
    xs = [torch.randn(1, 12, 12, 8).permute(0, 3, 1, 2) for _ in range(4)]  # NHWC, as LayerNorm2d
    with torch.no_grad():
        want = [conv(x) for x in xs]
        want_gelu = [nn.functional.gelu(w) for w in want]
        offload()
        got = [conv(x) for x in xs]
        got_gelu = [nn.functional.gelu(g).cpu() for g in got]
    assert [g.stride() for g in got] == [w.stride() for w in want]
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True))
    assert all(torch.equal(g, w) for g, w in zip(got_gelu, want_gelu, strict=True))
