"""Basic indexing with bounded slices (``plugins/torch/slicing.py``): the same view as
PyTorch's (values, strides, offset), by PyTorch's own calls plus a ``slice`` for each slice
PyTorch leaves out because it spans its dimension; every other index is left to PyTorch."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rrto_plugins.torch import slicing


class _Calls(TorchDispatchMode):
    """The operators a block dispatches, each with its non-tensor arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((str(func), tuple(a for a in args if not isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))


def _random_index(rng: random.Random) -> tuple:
    bounds = [None, 0, 1, 2, -1, -3, 3, 4, 5, 6, 9]
    items: list = []
    for _ in range(rng.randint(1, 4)):
        r = rng.random()
        if r < 0.15:
            items.append(None)
        elif r < 0.25:
            items.append(Ellipsis)
        elif r < 0.45:
            items.append(rng.choice([0, 1, -1, 2, 3]))
        else:
            items.append(slice(rng.choice(bounds), rng.choice(bounds),
                               rng.choice([None, None, 1, 2, 3])))
    return tuple(items)


def test_the_view_is_pytorchs_and_every_bounded_slice_is_a_call():
    t = torch.arange(4 * 5 * 6.0).reshape(4, 5, 6)
    rng = random.Random(7)
    checked = elided = 0
    for _ in range(2000):
        index = _random_index(rng)
        if not slicing.bounded(index):
            continue
        try:
            with _Calls() as theirs:
                want = t[index]
        except (IndexError, ValueError, RuntimeError) as exc:
            with pytest.raises(type(exc)):
                slicing.view(t, index)
            continue
        with _Calls() as ours:
            got = slicing.view(t, index)
        assert torch.equal(got, want) and got.stride() == want.stride(), index
        assert got.storage_offset() == want.storage_offset(), index
        pytorch = [c for c in theirs.calls if c[0] != "aten.alias.default"]
        extra = list(ours.calls)
        for c in pytorch:  # PyTorch's calls, in order, with only slices between them
            extra.remove(c)
        assert all(c[0] == "aten.slice.Tensor" for c in extra), (index, theirs.calls, ours.calls)
        n_slices = sum(1 for item in index if type(item) is slice and (
            item.start is not None or item.stop is not None or item.step is not None))
        assert sum(1 for c in ours.calls if c[0] == "aten.slice.Tensor") == n_slices, index
        checked += 1
        elided += bool(extra)
    assert checked > 1000 and elided > 50, (checked, elided)


def test_a_slice_whose_bounds_come_from_tensors_reads_them_as_pytorch_does():
    """A tensor bound is read by ``_local_scalar_dense``, the call PyTorch's slicing makes (a
    replay answers it), never by a download of its own; the whole-width slice is a call."""
    t = torch.zeros(4, 6)
    lo, hi = torch.tensor(0), torch.tensor(6)
    with _Calls() as ours:
        got = slicing.view(t, (slice(1, 3), slice(lo, hi)))
    assert [c[0] for c in ours.calls] == ["aten.slice.Tensor",
                                          "aten._local_scalar_dense.default",
                                          "aten._local_scalar_dense.default",
                                          "aten.slice.Tensor"]
    assert ours.calls[-1][1] == (1, 0, 6) and got.shape == (2, 6)


@pytest.mark.parametrize("index", [slice(None), (slice(None), 1), 1, None, Ellipsis,
                                   (torch.tensor([0, 1]), slice(0, 2)), [0, 1], True,
                                   (slice(0, 2), torch.tensor(True))])
def test_other_indices_are_pytorchs(index):
    """A bare ``:`` (PyTorch leaves it out whatever the data), integers, ``None``, ``...``,
    and advanced indices (tensors, lists, booleans) are not taken here."""
    assert not slicing.bounded(index)


def test_an_assignment_to_the_view_is_pytorchs_assignment():
    """``x[a:b] = v`` on a proxy is the view sliced here, then the value assigned to all of it
    (``view[...] = v``, ``proxy.py``): the same result as PyTorch's, a scalar or a tensor with
    a leading one. (Through a proxy: ``test_replay_apps``, ``paste_masks --full-width``.)"""
    t = torch.zeros(4, 6)
    u = t.clone()
    slicing.view(u, (slice(1, 3), slice(0, 6)))[...] = 2.0
    t[1:3, 0:6] = 2.0
    assert torch.equal(t, u)
    v = torch.arange(12.0).reshape(1, 2, 6)
    slicing.view(u, (slice(0, 2),))[...] = v
    t[0:2] = v
    assert torch.equal(t, u)
