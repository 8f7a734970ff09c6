"""Indexed assignment of a proxy with leading ones (``plugins/torch/assignment.py``): the view
PyTorch makes of the value is not sent where ``index_put_`` gives the same result without it,
is sent where it does not, and the app's tensors end up equal to local execution either way."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rrto_plugins.torch.assignment import _fits, leading_ones
from rrto_plugins.torch.testing import loopback


class Ops:
    """The loopback channel, keeping the operator of every call the shim sends."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.session, self.host, self.device = inner.session, inner.host, inner.device
        self.executor = inner.executor
        self.ops: list[str] = []

    def start(self, on_down, on_lost) -> None:
        self.inner.start(on_down, on_lost)

    def send(self, frames) -> None:
        self.ops += [f.call.op for f in frames if f.HasField("call")]
        self.inner.send(frames)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture
def session(tmp_path):
    itc = loopback(tmp_path, channel=Ops)
    yield itc.session
    itc.uninstall()


def upload(session: Any, t: torch.Tensor) -> torch.Tensor:
    """``t`` as a proxy of the session (a weight the host holds)."""
    return session.persist([t])[0]


def sent_views(session: Any) -> int:
    return sum(op.startswith("aten::view") for op in session.channel.ops)


def assign_both_ways(session: Any, target: torch.Tensor, index: Any,
                     value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``target[index] = value`` in the app and on proxies: (local result, offloaded one)."""
    want = target.clone()
    want[index] = value
    t, v = upload(session, target), upload(session, value)
    t[index] = v
    return want, t.cpu()


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_index_put_of_any_count_sends_no_view(session, rows):
    """``result[idx] = v``: the same calls whether ``v`` holds one row or more, and the same
    values as local execution."""
    want, got = assign_both_ways(session, torch.zeros(5, 3, 2), torch.tensor([4, 1, 2][:rows]),
                                 torch.arange(rows * 6.0).reshape(rows, 3, 2))
    assert sent_views(session) == 0, session.channel.ops
    assert any(op.startswith("aten::index_put_") for op in session.channel.ops)
    assert torch.equal(got, want)


@pytest.mark.parametrize("target, index, value, views", [
    # a boolean mask selecting one row: index_put_ takes the value as it is
    (torch.zeros(4, 3), torch.tensor([False, True, False, False]), torch.full((1, 3), 7.0), 0),
    # ``t`` one-dimensional, ``v`` of shape (1, k): without its leading one ``v`` fits, with
    # it ``index_put_`` would refuse: the view is sent
    (torch.zeros(6), torch.tensor([0, 3]), torch.tensor([[1.0, 2.0]]), 1),
    # a basic index (``copy_``, which does not drop leading ones): the view is sent
    (torch.zeros(3, 4), 1, torch.arange(4.0).reshape(1, 4), 1),
], ids=["boolean mask", "more dimensions than the indexed shape", "copy into a slice"])
def test_the_view_is_sent_only_where_the_value_itself_would_not_do(session, target, index,
                                                                    value, views):
    want, got = assign_both_ways(session, target, index, value)
    assert sent_views(session) == views and torch.equal(got, want)


def test_local_value_and_no_leading_ones_are_untouched(session):
    target = upload(session, torch.zeros(4, 2))
    target[torch.tensor([0])] = torch.ones(1, 2)  # a local value: uploaded, viewed by torch
    target[torch.tensor([1, 2])] = upload(session, torch.full((2, 2), 3.0))
    want = torch.zeros(4, 2)
    want[0], want[1:3] = 1.0, 3.0
    assert torch.equal(target.cpu(), want)


def test_leading_ones_and_fits():
    assert [leading_ones(s) for s in ((1, 3), (1, 1, 2), (2, 1), (1, 1), ())] == [1, 2, 0, 2, 0]
    t = torch.zeros(5, 3, 2)
    assert _fits(t, [torch.tensor([1])], torch.zeros(1, 3, 2))
    assert not _fits(torch.zeros(6), [torch.tensor([1])], torch.zeros(1, 1))
    assert _fits(t, [torch.tensor([[True, False, True]] * 5)], torch.zeros(1, 2))
    assert not _fits(t, [None, None], torch.zeros(1, 2))
