"""The idioms. Each is ``idiom(model, frames) -> list of outputs``, called after nothing but
the model's construction; the first inference (which starts offloading under the shim) happens
inside, before the idiom's own step, as in an app that already runs when it does it."""

from __future__ import annotations

import copy
import io
import os
import pickle
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn


class Net(nn.Module):
    """A small detector-like CNN with conv+bn pairs and a buffer the forward updates."""

    def __init__(self, count_calls: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.head = nn.Linear(16, 10)
        self.count_calls = count_calls
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.count_calls:  # state that changes between inferences, kept in a buffer
            self.calls.add_(1)
        y = self.body(x).mean((2, 3))
        return self.head(y) + self.calls


def make_model(seed: int = 0, **kw: Any) -> Net:
    torch.manual_seed(seed)
    model = Net(**kw).eval()
    with torch.no_grad():  # non-trivial BN statistics, so that fusing changes the weights
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return model


def frame(i: int) -> torch.Tensor:
    return torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(100 + i))


def infer(model: nn.Module, i: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    with torch.no_grad():
        return model(frame(i).to(dtype)).float().cpu()


def loop(model: nn.Module, frames: int, start: int = 1) -> list[torch.Tensor]:
    return [infer(model, i) for i in range(start, frames)]


def deepcopy_model(model, frames):
    out = [infer(model, 0)]
    twin = copy.deepcopy(model)  # ultralytics' predict() does this; so do EMA/trainer loops
    return out + loop(twin, frames) + [infer(model, 99)]


def deepcopy_tensor(model, frames):
    out = []
    for i in range(frames):
        with torch.no_grad():
            y = model(frame(i))
            twin = copy.deepcopy(y)
            y.add_(1.0)  # a copy, not an alias: the edit of the original leaves it as it was
        out += [twin.cpu(), y.cpu()]
    return out


def pickle_model(model, frames):
    out = [infer(model, 0)]
    twin = pickle.loads(pickle.dumps(model))
    buf = io.BytesIO()
    torch.save(model, buf)  # a checkpoint of the whole module must hold the real weights
    buf.seek(0)
    third = torch.load(buf, weights_only=False)
    # The loaded objects hold the real values (read before their first inference offloads them).
    out += [t.clone() for t in (*twin.state_dict().values(), *third.state_dict().values())]
    return out + loop(twin, frames) + [infer(third, 98)]


def save_state_dict(model, frames):
    out = [infer(model, 0)]
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf)
    out += [t.detach().clone() for t in state.values()]  # the real data, not proxies' bytes
    fresh = make_model(seed=7)
    fresh.load_state_dict(state)
    return out + loop(fresh, frames)


def load_state_dict_later(model, frames):
    out = [infer(model, 0)]
    model.load_state_dict(make_model(seed=3).state_dict())  # new weights mid-run
    return out + loop(model, frames)


def fuse_conv_bn(model, frames):
    out = [infer(model, 0)]
    from torch.nn.utils.fusion import fuse_conv_bn_eval
    body = model.body
    model.body = nn.Sequential(fuse_conv_bn_eval(body[0], body[1]), body[2],
                               fuse_conv_bn_eval(body[3], body[4]), body[5])
    return out + loop(model, frames)


def inplace_weight_edit(model, frames):
    out = [infer(model, 0)]
    with torch.no_grad():
        model.head.weight.mul_(0.5)
        model.head.bias.fill_(0.25)
    out.append(infer(model, 1))
    # Re-parameterizing nets (timm's reparameterize(), RepVGG) assign new values to .data,
    # or a new local Parameter to a module that is offloaded already.
    model.body[0].weight.data = model.body[0].weight.data * 0.5
    model.body[3].weight = nn.Parameter(torch.full_like(model.body[3].weight, 0.01))
    return out + loop(model, frames, start=2) + [model.body[3].weight.sum().detach()]


def half_float_to(model, frames):
    out = [infer(model, 0)]
    model.half().float()  # the round trip through float16 changes the weights (rounding)
    out += loop(model, 3)
    model.to(torch.float64)
    return out + [infer(model, i, torch.float64) for i in range(3, frames)]


def ema_copy(model, frames):
    ema = copy.deepcopy(model)
    out = []
    for i in range(frames):
        out.append(infer(model, i))
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                e.mul_(0.9).add_(p, alpha=0.1)
        out.append(infer(ema, i))
    return out


def threads(model, frames):
    out = [infer(model, 0)]
    results: dict[int, torch.Tensor] = {}

    def work(i: int) -> None:
        results[i] = infer(model, i)
    ts = [threading.Thread(target=work, args=(i,)) for i in range(1, frames)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out + [results[i] for i in range(1, frames)]


def thread_per_frame(model, frames):
    """Each frame on a thread of its own, one after the other (a server that starts a thread
    per request): no thread runs the model twice."""
    results: dict[int, torch.Tensor] = {}

    def work(i: int) -> None:
        results[i] = infer(model, i)
    for i in range(frames):
        t = threading.Thread(target=work, args=(i,))
        t.start()
        t.join()
    return [results[i] for i in range(frames)]


def worker_turns(model, frames):
    """Three long-lived workers take the frames in turn, one at a time (a ROS 2
    ``MultiThreadedExecutor`` whose pool threads take the next callback when free)."""
    import queue

    jobs = [queue.Queue() for _ in range(3)]
    done: queue.Queue = queue.Queue()

    def worker(q: queue.Queue) -> None:
        while (i := q.get()) is not None:
            done.put((i, infer(model, i)))
    workers = [threading.Thread(target=worker, args=(q,)) for q in jobs]
    for w in workers:
        w.start()
    results = {}
    for i in range(frames):
        jobs[i % 3].put(i)
        k, y = done.get()
        results[k] = y
    for q in jobs:
        q.put(None)
    for w in workers:
        w.join()
    return [results[i] for i in range(frames)]


class LateInput(nn.Module):
    """``net(x) + shift``: ``shift`` is an input only the last call reads, so a replay takes
    it mid-inference (a ``ReplayArg`` after the start)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        return self.net(x) + shift


def two_streams(model, frames):
    """Two long-lived threads run the model at the same time, frame after frame (two cameras
    served by one model): their inferences overlap all the time. Each frame also passes an
    input that only the model's last call reads."""
    wrapped = LateInput(model)
    results: dict[int, torch.Tensor] = {}
    start = threading.Barrier(2)

    def stream(first: int) -> None:
        start.wait()
        for i in range(first, frames, 2):
            with torch.no_grad():
                results[i] = wrapped(frame(i), torch.full((1, 10), float(i))).cpu()
    workers = [threading.Thread(target=stream, args=(k,)) for k in (0, 1)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return [results[i] for i in range(frames)]


class Frames(torch.utils.data.Dataset):
    """Pre-processing in the worker, and a model that runs there too (a teacher, a feature
    extractor): a worker is a forked child, so it must not use the parent's session."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = (frame(i)[0] - 0.5) / 0.25  # torch pre-processing in the worker
        with torch.no_grad():
            return x, self.model(x[None])[0]


def dataloader_workers(model, frames):
    out = [infer(model, 0)]
    with torch.no_grad():  # after offloading started: the workers must see these weights
        model.head.bias.fill_(0.25)
    loader = torch.utils.data.DataLoader(Frames(model), batch_size=1, num_workers=2)
    with torch.no_grad():
        for x, in_worker in loader:
            out += [model(x).cpu(), in_worker]
    return out


def fork_child(model, frames):
    out = [infer(model, 0)]
    with torch.no_grad():  # weights edited after offloading started: the child must see them
        model.head.weight.mul_(0.5)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child runs the model too: it must not share the parent's session
        try:
            torch.set_num_threads(1)  # GNU OpenMP hangs in a forked child otherwise
            y = infer(model, 1)
            os.write(w, y.numpy().tobytes())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.waitpid(pid, 0)
    out.append(torch.from_numpy(np.frombuffer(data, dtype=np.float32).copy()))
    return out + loop(model, frames, start=2)


def buffer_state(model, frames):
    model = make_model(count_calls=True)  # the forward adds 1 to a buffer, on the host
    out = [infer(model, i) for i in range(2)] + [model.calls.clone()]
    model.register_buffer("calls", torch.tensor(10.0))  # the app replaces it between inferences
    out += [infer(model, i) for i in range(2, frames)]
    return out + [model.calls.clone()]


def numpy_pil(model, frames):
    from PIL import Image
    out = []
    for i in range(frames):
        rgb = (frame(i)[0].permute(1, 2, 0).numpy() * 255).astype(np.uint8)
        img = Image.fromarray(rgb).resize((40, 40))  # as from a camera driver
        x = torch.from_numpy(np.asarray(img).astype(np.float32) / 255).permute(2, 0, 1)[None]
        with torch.no_grad():
            logits = model(x)
        probs = torch.softmax(logits, -1).numpy()  # post-processing in numpy
        out += [torch.from_numpy(probs), torch.tensor(int(np.argmax(probs)))]
    return out


def torch_compile(model, frames):
    """A compiled model and a compiled post-processing function, after offloading started.
    Under the shim both run eagerly with one warning line (plugins/torch/compiling.py). The
    "eager" backend: Dynamo traces, nothing is generated, so this runs on a machine without a
    C++ toolchain in seconds (inductor, the default, takes minutes on these 2 CPUs)."""
    out = [infer(model, 0)]
    compiled = torch.compile(model, backend="eager")

    @torch.compile(backend="eager")
    def scores(logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits, -1)

    for i in range(1, frames):
        with torch.no_grad():
            logits = compiled(frame(i))
            out += [logits.cpu(), scores(logits).cpu()]
    return out


IDIOMS: dict[str, Callable[[nn.Module, int], list[Any]]] = {
    f.__name__: f for f in (
        deepcopy_model, deepcopy_tensor, pickle_model, save_state_dict, load_state_dict_later,
        fuse_conv_bn, inplace_weight_edit, half_float_to, ema_copy, threads,
        thread_per_frame, worker_turns, two_streams,
        dataloader_workers, fork_child, buffer_state, numpy_pil, torch_compile)}
