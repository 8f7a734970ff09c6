"""An inference the scheduler placed whole on the robot runs the app's forward on its own
tensors, nothing intercepted (plugins/torch/here.py): the module's proxies are its original
tensors for that forward and are put back after it, even when it raises. A forward that writes
one of them in place leaves the host's copy older (``diverged``); a module in training, a
weight written on the host since, or another thread inside a forward keeps the inference on
the usual path."""

from __future__ import annotations

import collections
import threading

import pytest
import torch
from torch import nn

from rrto_plugins.torch.interceptor import TorchInterceptor
from rrto_plugins.torch.proxy import Handle, RemoteTensor, new_proxy


class _Channel:
    def mark(self, *args, **kwargs) -> None:
        pass


class _Replay:
    """What the interceptor asks of the replay client: whether this inference runs here."""

    def __init__(self) -> None:
        self.plan: object | None = "all on the robot"
        self.ran: list[object] = []
        self.counters: collections.Counter[str] = collections.Counter()

    def runs_here(self, thread: int) -> object | None:
        return self.plan

    def ran_here(self, plan: object) -> None:
        self.ran.append(plan)


class _Session:
    def __init__(self) -> None:
        self.channel = _Channel()
        self.counters: collections.Counter[str] = collections.Counter()
        self.replay = _Replay()
        self.lost = None
        self.diverged: set[int] = set()
        self.written: set[int] = set()  # written on the host since the app's copy
        self.mode = "stream"
        self.epoch = 0
        self.released: list[int] = []
        self.hot = None  # no replay: every call goes to ``dispatch``

    def dispatch(self, func, args, kwargs):
        """Only what making a proxy a parameter asks: an alias of the same handle. Anything
        else would be an operator reaching the host: never, for a forward run here."""
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            src = args[0]
            return new_proxy(src._rrto_handle, tuple(src.shape), src.stride(),
                             src.storage_offset(), src.dtype, "cpu")
        raise AssertionError(f"{func} reached the host")

    def local_is_current(self, h: Handle) -> bool:
        return h.local is not None and h.id not in self.written

    def inference_started(self) -> None:
        pass

    def thread_index(self) -> int:
        return 0


def _offloaded(session: _Session, model: nn.Module) -> dict[int, torch.Tensor]:
    """``model``'s parameters and buffers made proxies that keep the originals, as the
    interceptor's ``offload`` leaves them; the originals by handle id."""
    originals, ids = {}, iter(range(100, 10_000))
    for m in model.modules():
        for table, is_param in ((m._parameters, True), (m._buffers, False)):
            for name, t in table.items():
                if t is None:
                    continue
                h = Handle(session, next(ids), hash=b"h", local=t.detach())  # type: ignore[arg-type]
                proxy = new_proxy(h, tuple(t.shape), t.stride(), 0, t.dtype, "cpu")
                table[name] = nn.Parameter(proxy, requires_grad=False) if is_param else proxy
                originals[h.id] = t.detach()
    return originals


def _setup() -> tuple[TorchInterceptor, _Session, nn.Module, nn.Module]:
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).eval()
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).eval()
    model.load_state_dict(reference.state_dict())
    session = _Session()
    _offloaded(session, model)
    icpt = TorchInterceptor(session)  # type: ignore[arg-type]
    icpt.offloaded.update(model.modules())
    return icpt, session, model, reference


def _proxies(model: nn.Module) -> list[bool]:
    return [isinstance(t, RemoteTensor) for t in (*model.parameters(), *model.buffers())]


def test_a_forward_placed_on_the_robot_runs_on_the_apps_tensors():
    icpt, session, model, reference = _setup()
    x = torch.randn(5, 4)
    icpt._pre(model, (x,))
    assert not any(_proxies(model)) and not icpt._inside()  # factories make local tensors
    with torch.inference_mode():
        got = model(x)  # (no global hooks here: the interceptor's are called by hand)
    icpt._post(model, (x,), got)
    assert all(_proxies(model)) and session.replay.ran == ["all on the robot"]
    assert type(got) is torch.Tensor and torch.equal(got, reference(x).detach())
    assert not session.diverged


def test_the_proxies_come_back_when_the_forward_raises():
    icpt, session, model, _ = _setup()
    icpt._pre(model, ())
    with pytest.raises(RuntimeError):
        model(torch.randn(5, 7))  # wrong width
    icpt._post(model, (), None)  # (``always_call``: the hook runs on an exception too)
    assert all(_proxies(model))


class _Counting(nn.Module):
    """Counts its calls in a buffer, in place, in eval mode too."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return x


def test_a_forward_that_writes_a_weight_leaves_the_hosts_copy_older():
    icpt, session, model, _ = _setup()
    counting = _Counting().eval()
    _offloaded(session, counting)
    model.append(counting)
    icpt.offloaded.update(model.modules())
    icpt._pre(model, ())
    model(torch.randn(5, 4))
    icpt._post(model, (), None)
    assert session.diverged == {counting.calls._rrto_handle.id}
    assert torch.equal(counting.calls._rrto_handle.local, torch.ones(1))  # the newer copy
    icpt._pre(model, ())  # never runs here again: replay must not bind the host's older copy
    assert all(_proxies(model))
    icpt._post(model, (), None)


def test_a_module_in_training_never_runs_here():
    """Batch norm in training writes its running statistics from inside its kernel, which
    does not bump their version counters: nothing would show the host's copy older."""
    icpt, session, model, _ = _setup()
    model.train()
    icpt._pre(model, ())
    assert all(_proxies(model)) and not session.replay.ran
    icpt._post(model, (), None)


def test_a_weight_written_on_the_host_or_a_plan_not_all_here_keeps_the_usual_path():
    icpt, session, model, _ = _setup()
    session.written.add(model[0].weight._rrto_handle.id)
    icpt._pre(model, ())
    assert all(_proxies(model)) and not session.replay.ran
    icpt._post(model, (), None)
    session.written.clear()
    session.replay.plan = None
    icpt._pre(model, ())
    assert all(_proxies(model)) and not session.replay.ran
    icpt._post(model, (), None)


def test_not_while_another_thread_is_inside_a_forward():
    """The swap is the module's, not the thread's: with another thread in a forward (of any
    offloaded module), the inference takes the usual path."""
    icpt, session, model, _ = _setup()
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        session.replay.plan = None  # its own inference is not one to run here
        icpt._pre(model, ())
        inside.set()
        leave.wait(10)
        icpt._post(model, (), None)

    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(10)
    session.replay.plan = "all on the robot"
    icpt._pre(model, ())
    assert all(_proxies(model)) and not session.replay.ran
    icpt._post(model, (), None)
    leave.set()
    t.join(10)
    icpt._pre(model, ())
    assert not any(_proxies(model))
    icpt._post(model, (), None)
