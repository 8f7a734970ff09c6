"""The reviewed table of library operators (plugins/torch/libops.py): which ones a host runs,
the import probe, input guards, shape rules for sizing and for the app's metadata.

The fast tier has no torchvision: the suite's own library (tests/apps/rrtotest_ops.py, which
registers ``rrtotest`` and ``rrtoabsent`` in the table the way a daemon plugin would) stands in
for it. The torchvision table is checked against the real library where it is installed (the
compat venv). The end-to-end run through real daemons is in test_torch_apps.py."""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch

from rrto_plugins.torch import libops, sizing
from rrto_plugins.torch.allowlist import Allowlist, OpNotAllowed
from rrto_plugins.torch.metadata import MetaCache, OpInfo
from rrtod.opnames import is_name, unsafe_reason
from testkit.apps import APPS

sys.path.insert(0, str(APPS))
import rrtotest_ops  # noqa: E402,F401  registers rrtotest:: and its table entries


@torch.library.custom_op("rrtoguard::first_box", mutates_args=())
def first_box(input: torch.Tensor, rois: torch.Tensor) -> torch.Tensor:  # noqa: A002
    """Stands in for a RoI kernel: reads the image each box names (safely, here)."""
    return torch.stack([input[int(r[0])].sum() for r in rois]) if len(rois) else input.new_zeros(0)


@first_box.register_fake
def _(input: torch.Tensor, rois: torch.Tensor) -> torch.Tensor:  # noqa: A002
    return input.new_empty(rois.shape[0])


libops.register(libops.Library("rrtoguard", "torch", (
    libops.LibraryOp("rrtoguard::first_box.default", "test: a RoI-style guard",
                     guard=libops._rois_guard),)))


def test_reviewed_library_operators_are_admitted_without_configuration():
    allow = Allowlist()
    assert allow.resolve("rrtotest::keep_above.default")._schema.name == "rrtotest::keep_above"
    assert allow.allows("rrtotest::mul_add")  # overload defaults to .default


def test_only_listed_operators_of_a_library_namespace_are_admitted():
    with pytest.raises(OpNotAllowed, match="rrtotest::shift.default is not on this host's"):
        Allowlist().resolve("rrtotest::shift.default")


def test_a_host_without_the_library_refuses_with_the_import_error():
    with pytest.raises(OpNotAllowed, match="does not have the library rrtotest_absent_library "
                                           r"\(ModuleNotFoundError"):
        Allowlist().resolve("rrtoabsent::twice.default")


@pytest.mark.skipif("torchvision" in sys.modules or libops.probe("torchvision") is None,
                    reason="torchvision is installed here")
def test_torchvision_refused_cleanly_without_torchvision_even_if_configured():
    # the fast tier has no torchvision: neither the table nor a namespace entry can run it
    for allow in (Allowlist(), Allowlist(allow_extra=["torchvision::*"])):
        with pytest.raises(OpNotAllowed, match="does not have the library torchvision"):
            allow.resolve("torchvision::nms.default")


def test_configuration_cannot_make_the_host_import_a_module():
    # a namespace entry for a library the table does not know imports nothing
    before = set(sys.modules)
    with pytest.raises(OpNotAllowed, match="does not exist on this host"):
        Allowlist(allow_extra=["json::*"]).resolve("json::loads.default")
    assert set(sys.modules) == before


def test_denied_library_operator_is_refused():
    with pytest.raises(OpNotAllowed, match="denied"):
        Allowlist(deny=["rrtotest::*"]).resolve("rrtotest::keep_above.default")


def test_a_namespace_cannot_be_registered_twice_with_other_operators():
    with pytest.raises(ValueError, match="already registered"):
        libops.register(libops.Library("rrtotest", "rrtotest_ops", ()))
    with pytest.raises(ValueError, match="not in namespace"):
        libops.Library("a", "m", (libops.LibraryOp("b::c.default", "x"),))


def test_guard_refuses_out_of_range_batch_index_and_nan_boxes():
    op = Allowlist().resolve("rrtoguard::first_box")
    assert isinstance(op, libops.Guarded)
    images = torch.arange(24.0).reshape(2, 3, 2, 2)
    ok = torch.tensor([[1.0, 0, 0, 1, 1], [0.0, 0, 0, 1, 1]])
    assert torch.equal(op(images, ok), first_box(images, ok))
    for bad, why in ((torch.tensor([[2.0, 0, 0, 1, 1]]), "batch index"),
                     (torch.tensor([[-1.0, 0, 0, 1, 1]]), "batch index"),
                     (torch.tensor([[0.0, float("nan"), 0, 1, 1]]), "finite"),
                     (torch.tensor([[float("nan"), 0, 0, 1, 1]]), "finite"),
                     (torch.tensor([[0.0, 0, 0, 1]]), r"shape \[K, 5\]")):
        with pytest.raises(ValueError, match=why):
            op(images, bad)
        with pytest.raises(ValueError, match=why):
            op(images, rois=bad)  # by keyword too
    # sizing runs it on meta tensors first: shapes are checked, values cannot be
    assert sizing.new_bytes(op, [images, ok], {}) == 2 * 4


def test_shape_rule_bounds_what_the_host_admits():
    op = Allowlist().resolve("rrtotest::keep_above.default")
    x = torch.randn(100)
    assert sizing.new_bytes(op, [x, 0.0], {}) == 100 * 4  # at most every value, float32
    assert sizing.new_bytes(op, [x.double(), 0.0], {}) == 100 * 8  # dtype of argument x
    rule = libops.entry("rrtotest::keep_above.default").shape
    assert rule.data_dependent() == (0,)
    with pytest.raises(ValueError, match="dimension 0 of 'x'"):
        libops.bound_bytes(rule, op, [torch.tensor(1.0), 0.0], {})


def test_torchvision_table_is_well_formed():
    for name, lib_op in libops.libraries()["torchvision"].by_name.items():
        assert is_name(name) and name.endswith(".default") and unsafe_reason(name) is None
        assert len(lib_op.reason) > 20, name
    assert libops.entry("torchvision::nms.default").shape.data_dependent() == (0,)
    assert libops.entry("torchvision::roi_align.default").guard is libops._rois_guard


def test_app_asks_the_host_for_data_dependent_metadata_without_trying_meta():
    counters: Counter[str] = Counter()
    meta = MetaCache(counters)
    keep = torch.ops.rrtotest.keep_above.default
    assert OpInfo(keep).shape_rule is libops.entry("rrtotest::keep_above.default").shape
    assert meta.output_template(keep, (torch.randn(8), 0.0), {}) is None
    assert counters["meta_fallbacks"] == 0  # known, not a failed meta run
    tmpl, outs = meta.output_template(torch.ops.rrtotest.mul_add.default,
                                      (torch.randn(8), 2.0, 1.0), {})
    assert OpInfo(torch.ops.rrtotest.mul_add.default).shape_rule is None
    assert [o.shape for o in outs] == [(8,)]


def test_torchvision_table_matches_the_installed_library():
    tv = pytest.importorskip("torchvision")
    allow = Allowlist()
    for name in libops.libraries()["torchvision"].by_name:
        assert allow.allows(name), name
    nms = allow.resolve("torchvision::nms.default")
    boxes = torch.rand(50, 4) * 100
    boxes[:, 2:] += boxes[:, :2]
    scores = torch.rand(50)
    keep = nms(boxes, scores, 0.5)
    assert torch.equal(keep, tv.ops.nms(boxes, scores, 0.5)) and keep.dtype == torch.int64
    assert keep.numel() * 8 <= sizing.new_bytes(nms, [boxes, scores, 0.5], {})
    roi = allow.resolve("torchvision::roi_align.default")
    feats = torch.randn(1, 8, 16, 16)
    rois = torch.cat([torch.zeros(50, 1), boxes / 8], 1)
    assert torch.equal(roi(feats, rois, 1.0, 7, 7, 2, False),
                       tv.ops.roi_align(feats, rois, 7, 1.0, 2, False))
    with pytest.raises(ValueError, match="batch index"):
        roi(feats, rois + torch.tensor([1.0, 0, 0, 0, 0]), 1.0, 7, 7, 2, False)


def test_every_library_operator_of_the_generated_list_is_reviewed():
    # bench.oplist may list torchvision operators it saw; each needs a table entry (its guard)
    from rrto_plugins.torch.allowlist import builtin_entries
    unreviewed = [n for n in builtin_entries() if not n.startswith("aten::")
                  and libops.entry(n) is None]
    assert unreviewed == []
