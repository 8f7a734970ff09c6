"""The journal keeps each call as it was sent (plugins/torch/journal.py)."""

from __future__ import annotations

import torch

from rrto_plugins.torch.journal import Journal
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
