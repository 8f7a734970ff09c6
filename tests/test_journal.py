"""The journal keeps each call as it was sent (plugins/torch/journal.py)."""

from __future__ import annotations

import pytest
import torch

from rrto_plugins.torch.journal import Journal, Unrecoverable
from rrto_plugins.torch.proxy import Handle, new_proxy


class _Session:
    epoch = 0

    def __init__(self) -> None:
        self.released: list[int] = []
        self.stale_released: list[int] = []


def _proxy(session: _Session, i: int, shape: tuple[int, ...]) -> torch.Tensor:
    stride = torch.empty(shape).stride()
    return new_proxy(Handle(session, i), shape, stride, 0, torch.float32, torch.device("cpu"))


def test_a_list_argument_is_kept_as_sent_though_the_app_reuses_it():
    """Sizes in a list the app changes after the call (a reused buffer of sizes) rebuild as
    they were sent; a tuple of plain values, immutable, is kept as it is; a proxy inside a
    list becomes its id and rebuilds from the value that call made."""
    session = _Session()
    journal = Journal()
    x = torch.arange(6.0)
    sizes = [2, 3]
    view = _proxy(session, 10, (2, 3))
    journal.add(torch.ops.aten.view.default, (x, sizes), {}, view)
    sizes[:] = [3, 2]
    flat = _proxy(session, 11, (6,))
    journal.add(torch.ops.aten.reshape.default, (view, (6,)), {}, flat)
    stacked = _proxy(session, 12, (2, 6))
    journal.add(torch.ops.aten.stack.default, ([flat, flat],), {}, stacked)
    values = journal.rebuild(set(), {})
    assert values[10].shape == (2, 3) and torch.equal(values[10], x.view(2, 3))
    assert torch.equal(values[12], torch.stack([x, x]))


def test_an_inference_tensor_is_kept_as_a_copy_and_a_changed_local_tensor_refuses():
    """A tensor made under ``inference_mode`` has no version counter: the journal keeps a copy,
    so writing into the app's own tensor afterwards does not change what rebuilds. A tensor
    with a version that the app wrote into after sending it makes ``rebuild`` refuse."""
    session = _Session()
    journal = Journal()
    with torch.inference_mode():
        frame = torch.ones(3)
    doubled = _proxy(session, 20, (3,))
    journal.add(torch.ops.aten.mul.Tensor, (frame, 2.0), {}, doubled)
    with torch.inference_mode():
        frame.fill_(7.0)  # the app reuses its buffer
    assert torch.equal(journal.rebuild(set(), {})[20], torch.full((3,), 2.0))

    journal = Journal()
    reused = torch.ones(3)
    journal.add(torch.ops.aten.mul.Tensor, (reused, 2.0), {}, _proxy(session, 21, (3,)))
    reused.add_(1.0)
    with pytest.raises(Unrecoverable, match="changed since it was sent"):
        journal.rebuild(set(), {})
