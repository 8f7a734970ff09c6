"""Derive the GPU host's positive operator allowlist from models that real inference runs.

    python -m bench.oplist                 # observe what this interpreter can, then merge
    python -m bench.oplist --merge-only    # rewrite the list from the committed observations
    .venv-compat/bin/python -m bench.oplist --sources torchvision,timm,transformers
    .venv-compat/bin/python -m bench.oplist --sources compat --only '^(timm|hf)-'  # a subset

Observation: each model runs (random weights, built from its config: nothing is downloaded) under
the three grad modes apps use (default grad, ``no_grad``, ``inference_mode``: composite operators
such as ``conv2d`` arrive unexpanded under ``inference_mode`` only), and every operator overload
that reaches the Python dispatch key is recorded, which is the level at which the shim intercepts.
Two observers:

- ``shim``: the model runs through the real shim (``rrto_plugins.torch.testing.loopback``) and the
  host records every operator name the shim sends it, bookkeeping included (``aten::alias`` binds
  weights, ``copy_`` writes back, ``_local_scalar_dense`` reads scalars). Used for the correctness
  suite's apps (tests/apps) and the benchmark's models (bench/models.py): needs this repo installed.
- ``mode``: a ``TorchDispatchMode`` records every operator of the forward and a typical read-back.
  Used for the benchmark's models again and for third-party families (torchvision classification,
  segmentation, detection, optical flow and video; timm; transformers). A family whose library is
  missing is skipped with a note: the observations of each interpreter are kept apart
  (bench/results/oplist/<source>-torch<version>.json) and the merge reads them all, so the list is
  the union over both tested torch versions. ``compat`` observes the compatibility corpus
  (compat/models.yaml) with the corpus's own builder, input and call (``generate`` included).

Merge: every observed overload gets a reason class from ``CLASSES`` (a name no rule classifies
stops the merge: a human decides), internal or unsafe names (rrtod/opnames.py) are left out and
reported unless reviewed safe, and the list is written to plugins/torch/allowlist_ops.txt as
``name  reason-class  grad-modes  seen-in``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import re
import runpy
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # rrtod.opnames is torch-free and needs no install

from rrtod.opnames import unsafe_reason  # noqa: E402
from testkit.apps import APPS  # noqa: E402

OBS_DIR = REPO / "bench" / "results" / "oplist"
LIST = REPO / "plugins" / "torch" / "allowlist_ops.txt"
GRAD_MODES: dict[str, Callable[[], Any]] = {
    "grad": torch.enable_grad,
    "no_grad": torch.no_grad,
    "inference": torch.inference_mode,
}
NAMESPACES = ("aten", "torchvision")  # libraries whose operators the built-in list may hold
SOURCES = ("suite", "bench", "torchvision", "timm", "transformers", "compat")

# Reason classes, first match wins, on the base operator name (in-place "_" stripped). Every
# observed operator must match one: the merge refuses to guess.
CLASSES: tuple[tuple[str, str], ...] = (
    ("shim", r"alias|lift_fresh|lift_fresh_copy|detach|_local_scalar_dense|is_nonzero|item|"
             r"equal|is_same_size|_has_compatible_shallow_copy_type"),
    ("creation/uninitialized", r"empty|empty_like|empty_strided|new_empty|new_empty_strided|"
                               r"empty_permuted|resize|resize_as|_resize_output"),
    ("copy/dtype", r"_to_copy|copy|clone|contiguous|to|type_as|_autocast_to_\w+|"
                   r"view_as_real|view_as_complex|_conj|conj|resolve_conj|resolve_neg"),
    ("conv/matmul", r"\w*conv\w*|convolution|_convolution|mm|bmm|addmm|_addmm_activation|matmul|"
                    r"linear|baddbmm|addbmm|einsum|mv|addmv|dot|vdot|outer|ger|tensordot|"
                    r"bilinear|_trilinear|\w*scaled_dot_product\w*|_native_multi_head_attention|"
                    r"_transformer_encoder_layer_fwd|\w*attention\w*|_weight_int\w*"),
    ("normalization", r"\w*batch_norm\w*|\w*layer_norm\w*|\w*group_norm\w*|instance_norm|"
                      r"\w*rms_norm\w*|local_response_norm|_batch_norm_impl_index|"
                      r"_native_batch_norm_legit\w*|renorm"),
    ("recurrent", r"gru|lstm|rnn_tanh|rnn_relu|gru_cell|lstm_cell|rnn_tanh_cell|rnn_relu_cell|"
                  r"_thnn_fused_\w+_cell"),
    ("pooling/resampling", r"\w*pool\w*|upsample_\w+|_upsample_\w+|grid_sampler\w*|"
                           r"affine_grid_generator|pixel_shuffle|pixel_unshuffle|im2col|col2im|"
                           r"channel_shuffle|native_channel_shuffle"),
    ("reduction", r"sum|nansum|mean|nanmean|amax|amin|max|min|argmax|argmin|norm|\w*_norm|"
                  r"linalg_\w*norm|var|std|var_mean|std_mean|prod|cumsum|cumprod|logcumsumexp|"
                  r"logsumexp|all|any|softmax|_softmax|log_softmax|_log_softmax|_safe_softmax|"
                  r"topk|sort|argsort|msort|median|nanmedian|mode|kthvalue|count_nonzero|"
                  r"aminmax|cummax|cummin|_cummax_helper|_cummin_helper|histc|bincount|dist|"
                  r"cdist|_cdist_forward|_euclidean_dist|cosine_similarity|pairwise_distance|"
                  r"special_\w*softmax"),
    ("indexing/gather", r"index|_index\w*|index_select|gather|scatter|scatter_add|scatter_reduce|"
                        r"index_put|index_add|index_copy|index_fill|index_reduce|masked_fill|"
                        r"masked_select|masked_scatter|where|nonzero|nonzero_static|argwhere|take|"
                        r"take_along_dim|embedding|embedding_bag|_embedding_bag\w*|searchsorted|"
                        r"bucketize|unique\w*|_unique\w*|one_hot|select_scatter|slice_scatter|"
                        r"diagonal_scatter|tril|triu|isin|put|_masked_\w+"),
    ("view/shape", r"view|_unsafe_view|reshape|_reshape_copy|permute|transpose|t|expand|"
                   r"expand_as|squeeze|unsqueeze|flatten|unflatten|select|slice|narrow|"
                   r"narrow_copy|split|split_with_sizes|unsafe_split|unsafe_split_with_sizes|"
                   r"chunk|unsafe_chunk|unbind|unfold|movedim|moveaxis|diagonal|diag|diag_embed|"
                   r"flip|fliplr|flipud|roll|rot90|cat|concat|concatenate|stack|hstack|vstack|"
                   r"dstack|column_stack|repeat|repeat_interleave|tile|pad|constant_pad_nd|"
                   r"\w+_pad\dd|_pad_\w+|view_as|reshape_as|swapaxes|swapdims|meshgrid|"
                   r"broadcast_to|broadcast_tensors|tensor_split|hsplit|vsplit|dsplit|"
                   r"numpy_T|mT|mH|matrix_H|adjoint|_unsafe_\w*view\w*|\w+_copy|atleast_\dd|"
                   r"ravel|align_as|refine_names"),
    ("creation", r"zeros|ones|full|zeros_like|ones_like|full_like|new_zeros|new_ones|new_full|"
                 r"new_tensor|arange|linspace|logspace|eye|scalar_tensor|rand|randn|randint|"
                 r"rand_like|randn_like|randint_like|randperm|bernoulli|normal|uniform|"
                 r"exponential|tensor|tril_indices|triu_indices|fill|zero|_fill_\w+|"
                 r"polar|complex|cartesian_prod|combinations|vander|_efficientzerotensor"),
    ("detection", r"nms|roi_align|roi_pool|ps_roi_align|ps_roi_pool|_roi_align|"
                  r"deform_conv2d|batched_nms"),
    ("elementwise", r"add|sub|rsub|mul|div|true_divide|floor_divide|remainder|fmod|neg|abs|"
                    r"absolute|sign|sgn|signbit|pow|float_power|sqrt|rsqrt|square|exp|exp2|"
                    r"expm1|log|log2|log10|log1p|logaddexp|logaddexp2|sin|cos|tan|asin|acos|"
                    r"atan|atan2|arctan2|sinh|cosh|tanh|asinh|acosh|atanh|sinc|erf|erfc|erfinv|"
                    r"lgamma|digamma|sigmoid|logit|relu|relu6|leaky_relu|elu|selu|celu|gelu|"
                    r"silu|mish|softplus|softshrink|hardshrink|hardtanh|hardswish|hardsigmoid|"
                    r"threshold|prelu|_prelu_kernel|rrelu|glu|clamp|clamp_min|clamp_max|clip|"
                    r"maximum|minimum|fmax|fmin|lerp|addcmul|addcdiv|floor|ceil|round|trunc|"
                    r"frac|fix|reciprocal|eq|ne|lt|le|gt|ge|greater|less|greater_equal|"
                    r"less_equal|not_equal|logical_and|logical_or|logical_xor|logical_not|"
                    r"bitwise_and|bitwise_or|bitwise_xor|bitwise_not|bitwise_left_shift|"
                    r"bitwise_right_shift|__and__|__or__|__xor__|__lshift__|__rshift__|"
                    r"__iand__|__ior__|isnan|isinf|isfinite|isposinf|isneginf|isclose|allclose|"
                    r"nan_to_num|heaviside|hypot|copysign|nextafter|xlogy|deg2rad|rad2deg|"
                    r"positive|dropout|native_dropout|feature_dropout|alpha_dropout|"
                    r"feature_alpha_dropout|_masked_softmax|polygamma|i0|special_\w+|"
                    r"_foobar|fused_moving_avg_obs_fake_quant|real|imag|angle|"
                    r"_standard_gamma|_sample_dirichlet|_s_where|sigmoid_backward|"
                    r"threshold_backward|_assert_tensor_metadata|sym_\w+|_assert_scalar|"
                    r"is_floating_point|is_complex|is_signed|size|stride|storage_offset|numel|"
                    r"dim|_shape_as_tensor|_reshape_from_tensor|result_type|can_cast|"
                    r"promote_types|_has_same_storage_numel|is_contiguous|_nnz|"
                    r"is_coalesced|data|requires_grad|retain_grad|_version|output_nr|"
                    r"_is_\w+|is_conj|is_neg|is_inference|is_leaf|_functionalize_\w+"),
)
_CLASS_RES = [(cls, re.compile(rf"^(?:{pattern})$")) for cls, pattern in CLASSES]


def overload_name(func: Any) -> str:
    """``ns::op.overload``, ``.default`` included, as the shim names operators on the wire."""
    return f"{func.namespace}::{func._schema.name.split('::')[-1]}.{func._overloadname}"


def classify(name: str) -> str | None:
    ns, _, rest = name.partition("::")
    base = rest.split(".", 1)[0]
    stripped = base.rstrip("_") if not base.startswith("__") else base
    if ns == "torchvision":
        return "detection"
    for cls, pattern in _CLASS_RES:
        if pattern.match(stripped) or pattern.match(base):
            return cls
    return None


class OpRecorder(TorchDispatchMode):
    """Records every operator overload that reaches the Python dispatch key."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops.add(overload_name(func))
        return func(*args, **(kwargs or {}))


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif hasattr(value, "to_tuple"):  # transformers' ModelOutput
        yield from _tensors(value.to_tuple())


def read_back(out: Any) -> None:
    """What an app does with its results: read values (as appkit.describe and bench/app.py do)."""
    for t in _tensors(out):
        t = t.detach()
        if t.numel():
            t.contiguous().flatten()[:3].tolist()
            t.reshape(-1)[0].item()


def observe_forward(build: Callable[[], torch.nn.Module], make_input: Callable[[], Any],
                    grad_mode: str) -> set[str]:
    """Operators of one forward pass (plus read-back) of a freshly built model in ``grad_mode``."""
    torch.manual_seed(0)
    model = build().eval()
    x = make_input()
    rec = OpRecorder()
    with GRAD_MODES[grad_mode](), rec:
        out = model(*x) if isinstance(x, tuple) else (model(**x) if isinstance(x, dict)
                                                     else model(x))
        read_back(out)
    return rec.ops


# -- the shim observer -------------------------------------------------------------------------
class _RecordingAllowlist:
    """Stands in for the host's allowlist: admits every operator that exists, records names."""

    def __init__(self) -> None:
        from rrto_plugins.torch import allowlist

        self._lookup, self._error = allowlist._lookup, allowlist.OpNotAllowed
        self.names: set[str] = set()

    def resolve(self, name: str) -> Any:
        self.names.add(name)
        if name.startswith("oplist::"):  # lifecycle(): an operator the host refuses
            raise self._error(f"operator {name} is not allowed on this host")
        op = self._lookup(name) if re.match(r"^\w+::\w+(\.\w+)?$", name) else None
        if op is None:
            raise self._error(f"operator {name} does not exist on this host")
        return op

    def allows(self, name: str) -> bool:
        return self._lookup(name) is not None


@contextlib.contextmanager
def shim_host() -> Iterator[_RecordingAllowlist]:
    """The real shim installed in this process, its host an in-process executor that records."""
    from rrto_plugins.torch.testing import loopback

    with tempfile.TemporaryDirectory(prefix="rrto-oplist-") as tmp:
        itc = loopback(Path(tmp))
        recorder = _RecordingAllowlist()
        itc.session.channel.executor.allow = recorder
        try:
            yield recorder
        finally:
            itc.uninstall()
            itc.session.channel.close()


def observe_app_through_shim(app: Path, grad_mode: str) -> set[str]:
    """Run a correctness-suite app script through the shim with its grad mode forced."""
    sys.path.insert(0, str(APPS))
    try:
        appkit = importlib.import_module("appkit")
        saved = dict(appkit.MODES)
        appkit.MODES.update({k: GRAD_MODES[grad_mode] for k in appkit.MODES})
        argv = sys.argv
        sys.argv = [str(app)]
        try:
            with shim_host() as rec, contextlib.redirect_stdout(io.StringIO()):
                runpy.run_path(str(app), run_name="__main__")
        finally:
            sys.argv = argv
            appkit.MODES.update(saved)
        return rec.names
    finally:
        sys.path.remove(str(APPS))


def observe_forward_through_shim(build: Callable[[], torch.nn.Module],
                                 make_input: Callable[[], Any], grad_mode: str) -> set[str]:
    with shim_host() as rec:
        torch.manual_seed(0)
        model = build().eval()
        for _ in range(2):  # the second inference may already be matched for replay
            with GRAD_MODES[grad_mode]():
                read_back(model(make_input()))
        return rec.names


def lifecycle_through_shim(grad_mode: str) -> set[str]:
    """The glue apps write around a model, through the shim: dtype conversions, scalar reads,
    a branch on a result, in-place edits of an output, and an operator the host refuses (the
    shim runs it here and writes the mutated proxy back with ``copy_``)."""
    from torch import nn

    if not hasattr(torch.ops.oplist, "bump_"):
        @torch.library.custom_op("oplist::bump_", mutates_args=("x",))
        def bump_(x: torch.Tensor) -> None:
            x.add_(1)

    with shim_host() as rec:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).eval()
        with GRAD_MODES[grad_mode]():
            y = model(torch.rand(2, 8))
            y = y.detach()
            z = y.to(torch.float64).float().half().float()
            if bool((z > 0).any()):
                z = z * 2
            z[:, 0] = 0.5
            z.clamp_(-1, 1)
            torch.ops.oplist.bump_(z)
            z.sum().item()
            z.argmax(-1).tolist()
            z.cpu().numpy()
        return {n for n in rec.names if not n.startswith("oplist::")}


# -- model families ------------------------------------------------------------------------------
Case = tuple[str, Callable[[], torch.nn.Module], Callable[[], Any]]


def _img(*shape: int) -> Callable[[], torch.Tensor]:
    return lambda: torch.rand(*shape, generator=torch.Generator().manual_seed(1))


def bench_cases() -> list[Case]:
    from bench.models import MODELS

    # The benchmark's own seeded model and first input (``ModelSpec.make``/``inputs``): the
    # operators observed are those the benchmark sends (a detector's post-processing takes
    # the branches its inputs lead to).
    return [(name, spec.make, lambda spec=spec: spec.inputs(1)[0]) for name, spec in MODELS.items()]


def torchvision_cases() -> list[Case]:
    from torchvision import models as tvm
    from torchvision.models import detection, optical_flow, segmentation, video

    img224 = _img(1, 3, 224, 224)
    cases: list[Case] = [
        (n, (lambda n=n: getattr(tvm, n)(weights=None)), img224)
        for n in ("resnet18", "resnet50", "mobilenet_v2", "mobilenet_v3_small",
                  "mobilenet_v3_large", "efficientnet_b0", "efficientnet_v2_s", "convnext_tiny",
                  "vit_b_16", "swin_t", "swin_v2_t", "regnet_y_400mf", "regnet_x_400mf",
                  "densenet121", "squeezenet1_1", "shufflenet_v2_x1_0", "mnasnet0_5",
                  "googlenet", "inception_v3", "alexnet", "vgg11_bn", "maxvit_t", "wide_resnet50_2")
    ]
    cases[[c[0] for c in cases].index("googlenet")] = (
        "googlenet", lambda: tvm.googlenet(weights=None, aux_logits=False, init_weights=True),
        img224)
    cases[[c[0] for c in cases].index("inception_v3")] = (
        "inception_v3", lambda: tvm.inception_v3(weights=None, aux_logits=False,
                                                 init_weights=True), _img(1, 3, 299, 299))
    seg = _img(1, 3, 256, 256)
    for n in ("fcn_resnet50", "deeplabv3_resnet50", "deeplabv3_mobilenet_v3_large",
              "lraspp_mobilenet_v3_large"):
        cases.append((n, lambda n=n: getattr(segmentation, n)(weights=None,
                                                              weights_backbone=None), seg))
    # Detection post-processing (box decoding, NMS, mask pasting, keypoints) runs only on boxes
    # that pass the score threshold: with random weights, keep every box.
    det = lambda: ([torch.rand(3, 256, 320, generator=torch.Generator().manual_seed(1))],)  # noqa: E731
    small = {"min_size": 256, "max_size": 320}
    for n, kw in (("fasterrcnn_resnet50_fpn", {"box_score_thresh": 0.0, **small}),
                  ("fasterrcnn_mobilenet_v3_large_fpn", {"box_score_thresh": 0.0, **small}),
                  ("fasterrcnn_resnet50_fpn_v2", {"box_score_thresh": 0.0, **small}),
                  ("retinanet_resnet50_fpn", {"score_thresh": 0.0, **small}),
                  ("fcos_resnet50_fpn", {"score_thresh": 0.0, **small}),
                  ("ssdlite320_mobilenet_v3_large", {"score_thresh": 0.0}),
                  ("ssd300_vgg16", {"score_thresh": 0.0}),
                  ("maskrcnn_resnet50_fpn", {"box_score_thresh": 0.0, **small}),
                  ("keypointrcnn_resnet50_fpn", {"box_score_thresh": 0.0, **small})):
        cases.append((n, lambda n=n, kw=kw: getattr(detection, n)(
            weights=None, weights_backbone=None, detections_per_img=20, **kw), det))
    flow = lambda: (_img(1, 3, 128, 128)(), _img(1, 3, 128, 128)())  # noqa: E731
    cases.append(("raft_small", lambda: _Raft(optical_flow.raft_small(weights=None)), flow))
    cases.append(("r3d_18", lambda: video.r3d_18(weights=None), _img(1, 3, 4, 64, 64)))
    cases.append(("mvit_v2_s", lambda: video.mvit_v2_s(weights=None), _img(1, 3, 16, 224, 224)))
    return cases


class _Raft(torch.nn.Module):
    """RAFT with few refinement steps (the operators repeat per step)."""

    def __init__(self, raft: torch.nn.Module):
        super().__init__()
        self.raft = raft

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> Any:
        return self.raft(a, b, num_flow_updates=2)


def timm_cases() -> list[Case]:
    import timm

    img = _img(1, 3, 224, 224)
    names = ("resnet50d", "efficientnet_b0", "mobilenetv3_small_100", "convnext_atto",
             "vit_tiny_patch16_224", "deit_tiny_patch16_224", "swin_tiny_patch4_window7_224",
             "regnety_002", "mobilevit_xxs", "ghostnet_100", "levit_128s", "efficientformer_l1",
             "edgenext_xx_small", "fastvit_t8", "poolformer_s12", "cspdarknet53", "repvgg_a0",
             "mixer_s16_224", "coatnet_nano_rw_224", "rexnet_100", "dla34", "hrnet_w18_small",
             "efficientvit_b0", "mobilenetv4_conv_small", "eva02_tiny_patch14_224")
    return [(n, (lambda n=n: timm.create_model(n, pretrained=False)), img) for n in names]


def transformers_cases() -> list[Case]:
    import transformers as hf

    def ids() -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        return {"input_ids": torch.randint(0, 1000, (1, 24), generator=g),
                "attention_mask": torch.ones(1, 24, dtype=torch.long)}

    def pix(size: int = 224) -> Callable[[], dict[str, torch.Tensor]]:
        return lambda: {"pixel_values": _img(1, 3, size, size)()}

    small = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 256}
    cases: list[Case] = [
        ("bert", lambda: hf.BertModel(hf.BertConfig(vocab_size=1000, **small)), ids),
        ("distilbert", lambda: hf.DistilBertModel(hf.DistilBertConfig(
            vocab_size=1000, dim=128, n_layers=2, n_heads=4, hidden_dim=256)), ids),
        ("gpt2", lambda: hf.GPT2LMHeadModel(hf.GPT2Config(vocab_size=1000, n_embd=128, n_layer=2,
                                                          n_head=4)), ids),
        ("t5", lambda: hf.T5EncoderModel(hf.T5Config(vocab_size=1000, d_model=128, d_ff=256,
                                                     num_layers=2, num_heads=4, d_kv=32)), ids),
        ("vit", lambda: hf.ViTModel(hf.ViTConfig(image_size=224, **small)), pix()),
        ("swin", lambda: hf.SwinModel(hf.SwinConfig(embed_dim=32, depths=[1, 1], num_heads=[2, 4])),
         pix()),
        ("clip_vision", lambda: hf.CLIPVisionModel(hf.CLIPVisionConfig(image_size=224, **small)),
         pix()),
        ("detr", lambda: hf.DetrForObjectDetection(hf.DetrConfig(
            use_timm_backbone=False, use_pretrained_backbone=False, backbone="resnet50",
            backbone_config=hf.ResNetConfig(depths=[1, 1, 1, 1]), d_model=128, encoder_layers=2,
            decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            num_queries=20)), pix(256)),
        ("segformer", lambda: hf.SegformerForSemanticSegmentation(hf.SegformerConfig(
            depths=[1, 1, 1, 1], hidden_sizes=[16, 32, 64, 128], decoder_hidden_size=64)),
         pix(256)),
    ]
    return cases


class _CompatCall(torch.nn.Module):
    """A compatibility-corpus model called as the corpus calls it (``forward``, ``generate``,
    ``predict``): ``compat.app.infer`` on the model ``compat.app.build`` builds."""

    def __init__(self, entry: dict[str, Any]):
        super().__init__()
        from compat.app import build

        self.entry = entry
        self.model = build(entry)

    def eval(self) -> _CompatCall:
        if hasattr(self.model, "eval"):
            self.model.eval()
        return self

    def forward(self, x: Any) -> Any:
        from compat.app import infer

        return infer(self.model, self.entry, x)


def compat_cases() -> list[Case]:
    """Every model of the compatibility corpus (compat/models.yaml, issue 12), built, fed and
    called by the corpus's own code; a library this interpreter lacks fails per model."""
    import timm  # noqa: F401  the corpus's libraries (ultralytics is optional: its
    import torchvision  # noqa: F401  models fail one by one, with a note, where it is missing)
    import transformers  # noqa: F401
    import yaml

    from compat.app import make_input

    entries = yaml.safe_load((REPO / "compat" / "models.yaml").read_text())
    return [(e["name"], (lambda e=e: _CompatCall(e)),
             (lambda e=e: (make_input(e["input"], 0),))) for e in entries]


FAMILIES: dict[str, Callable[[], list[Case]]] = {
    "bench": bench_cases, "torchvision": torchvision_cases, "timm": timm_cases,
    "transformers": transformers_cases, "compat": compat_cases,
}


# -- observation runs ------------------------------------------------------------------------------
def _note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def observe(source: str, shim_ok: bool, only: str | None = None) -> dict[str, list[str]] | None:
    """op name -> ["model@grad-mode", ...] for one source; None when it cannot run here.
    ``only``: a regular expression; models whose name it does not match are skipped."""
    seen: dict[str, set[str]] = {}

    def add(ops: set[str], where: str) -> None:
        for op in ops:
            seen.setdefault(op, set()).add(where)

    if source == "suite":
        if not shim_ok:
            _note("suite: skipped (the shim is not installed in this interpreter)")
            return None
        for app in sorted(APPS.glob("*.py")):
            if app.stem in ("appkit", "rrtotest_ops"):
                continue
            for mode in GRAD_MODES:
                t0 = time.monotonic()
                add(observe_app_through_shim(app, mode), f"{app.stem}@{mode}")
                _note(f"suite {app.stem}@{mode}: {time.monotonic() - t0:.1f} s")
        for mode in GRAD_MODES:
            add(lifecycle_through_shim(mode), f"lifecycle@{mode}")
        return {k: sorted(v) for k, v in sorted(seen.items())}
    try:
        cases = FAMILIES[source]()
    except ImportError as exc:
        _note(f"{source}: skipped ({exc})")
        return None
    for name, build, make_input in cases:
        if only is not None and not re.search(only, name):
            continue
        for mode in GRAD_MODES:
            t0 = time.monotonic()
            try:
                add(observe_forward(build, make_input, mode), f"{name}@{mode}")
                if source == "bench" and shim_ok:
                    add(observe_forward_through_shim(build, make_input, mode),
                        f"{name}@{mode}+shim")
            except Exception as exc:  # a model this library version cannot build: say so
                _note(f"{source} {name}@{mode}: FAILED {type(exc).__name__}: {exc}"[:300])
                continue
            _note(f"{source} {name}@{mode}: {time.monotonic() - t0:.1f} s")
    return {k: sorted(v) for k, v in sorted(seen.items())}


def _shim_available() -> bool:
    try:
        importlib.import_module("rrto_plugins.torch.testing")
    except ImportError:
        return False
    return True


# -- merge -------------------------------------------------------------------------------------------
def merge(out: Path = LIST) -> int:
    """Union of every observation file -> the committed list. Returns the number of entries."""
    ops: dict[str, dict[str, set[str]]] = {}
    versions = []
    for path in sorted(OBS_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        versions.append(f"{data['source']}@torch{data['torch']}")
        for name, where in data["ops"].items():
            entry = ops.setdefault(name, {"modes": set(), "seen": set()})
            for w in where:
                model, _, mode = w.partition("@")
                entry["modes"].add(mode.removesuffix("+shim"))
                entry["seen"].add(data["source"] + ("+shim" if mode.endswith("+shim") or
                                                    data["source"] == "suite" else ""))
    # An app's own torch.library namespace (the suite's rrtotest::) is that app's business: a
    # host names it in allow_extra. The built-in list holds the libraries models share.
    foreign = sorted(n for n in ops if n.split("::", 1)[0] not in NAMESPACES)
    for name in foreign:
        del ops[name]
    unclassified = sorted(n for n in ops if classify(n) is None and unsafe_reason(n) is None)
    if unclassified:
        raise SystemExit("no reason class for: " + ", ".join(unclassified)
                         + "\n(add a rule to CLASSES in bench/oplist.py)")
    lines, left_out = [], []
    for name in sorted(ops):
        why = unsafe_reason(name)
        if why is not None:
            left_out.append(f"{name} ({why})")
            continue
        e = ops[name]
        modes = ",".join(m for m in GRAD_MODES if m in e["modes"])
        lines.append(f"{name:60s} {classify(name):24s} {modes:24s} {','.join(sorted(e['seen']))}")
    header = [
        "# The GPU host's positive operator allowlist: the overloads real inference models send.",
        "# Generated by `python -m bench.oplist` (docs/allowlist.md); do not edit by hand.",
        f"# Observations: {', '.join(versions)}",
        "# Internal/unsafe names observed and left out (rrtod/opnames.py): "
        + ("; ".join(left_out) or "none"),
        "# App-library operators observed and left out (allow_extra): " + (", ".join(foreign)
                                                                          or "none"),
        "# name  reason-class  grad-modes  seen-in",
    ]
    out.write_text("\n".join(header + lines) + "\n")
    _note(f"{len(lines)} operators -> {out.relative_to(REPO)}; left out: {len(left_out)}")
    return len(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.oplist", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sources", default=",".join(SOURCES),
                        help=f"comma-separated, of {', '.join(SOURCES)}")
    parser.add_argument("--merge-only", action="store_true")
    parser.add_argument("--only", metavar="REGEX",
                        help="observe only the models whose name matches; their operators are "
                             "added to the source's earlier observations instead of replacing them")
    args = parser.parse_args(argv)
    if not args.merge_only:
        torch.set_num_threads(max(1, torch.get_num_threads()))
        shim_ok = _shim_available()
        OBS_DIR.mkdir(parents=True, exist_ok=True)
        version = torch.__version__.split("+")[0]
        for source in args.sources.split(","):
            seen = observe(source.strip(), shim_ok, args.only)
            if seen is None:
                continue
            path = OBS_DIR / f"{source}-torch{version}.json"
            if args.only and path.exists():  # a partial run adds to what was seen before
                for name, where in json.loads(path.read_text())["ops"].items():
                    seen[name] = sorted(set(seen.get(name, [])) | set(where))
                seen = dict(sorted(seen.items()))
            path.write_text(json.dumps({"source": source, "torch": version, "device": "cpu",
                                        "ops": seen}, indent=0, sort_keys=True) + "\n")
            _note(f"{source}: {len(seen)} operators -> {path.relative_to(REPO)}")
    merge()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
