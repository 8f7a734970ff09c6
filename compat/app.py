"""One corpus entry as an app: build a third-party model from its config (random weights, fixed
seed, nothing downloaded), then run it as a camera/sensor loop would: a few frames of batch 1,
one input size, outputs read back to the CPU each frame.

    python -m compat.app --entry '<json of one compat/models.yaml entry>' --dump out.npz

The same command runs locally and under ``rrto-run``; the driver (``compat/__main__.py``)
compares the two dumps. With ``--window K`` the app prints ``MARK`` and waits for a line on
stdin before the last K frames and after them, so the driver can read the daemon's counters of
exactly those steady frames (``rrtoctl status``) without any instrumentation in the app.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
import time
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("YOLO_OFFLINE", "1")

import torch  # noqa: E402

SEED = 0


def resolve(path: str) -> Any:
    """``"package.module:attr.attr"`` -> the object."""
    module, _, attr = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in filter(None, attr.split(".")):
        obj = getattr(obj, part)
    return obj


def build(entry: dict[str, Any]) -> Any:
    torch.manual_seed(SEED)
    kwargs = entry.get("kwargs", {})
    if "config" in entry:  # transformers: Model(Config(**config_kwargs))
        config = resolve(entry["config"])(**entry.get("config_kwargs", {}))
        return resolve(entry["build"])(config, **kwargs)
    if entry["library"] == "ultralytics":
        from ultralytics import YOLO
        return YOLO(entry["build"], task=entry.get("task"), verbose=False)
    return resolve(entry["build"])(**kwargs)


def make_input(spec: dict[str, Any], frame: int) -> Any:
    """Frame ``frame``'s input: a fresh random tensor each frame, as a camera gives."""
    g = torch.Generator().manual_seed(1000 + frame)
    kind = spec["kind"]
    if kind == "image":
        return torch.rand(1, *spec["shape"], generator=g)
    if kind == "image_pair":  # optical flow: two consecutive frames
        return (torch.rand(1, *spec["shape"], generator=g),
                torch.rand(1, *spec["shape"], generator=g))
    if kind == "image_list":  # torchvision detection: a list of CHW images
        return [torch.rand(*spec["shape"], generator=g)]
    if kind == "tokens":
        ids = torch.randint(spec.get("low", 0), spec["vocab"], (1, spec["length"]), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if kind == "features":  # e.g. Whisper's log-mel features
        return {"input_features": torch.randn(1, *spec["shape"], generator=g)}
    if kind == "pixels":  # transformers image models
        return {"pixel_values": torch.rand(1, *spec["shape"], generator=g)}
    if kind == "clip":
        ids = torch.randint(0, spec["vocab"], (1, spec["length"]), generator=g)
        return {"input_ids": ids, "pixel_values": torch.rand(1, *spec["shape"], generator=g)}
    if kind == "numpy_image":  # ultralytics predict(): an HWC uint8 BGR frame, as from OpenCV
        return (torch.rand(*spec["shape"], generator=g) * 255).to(torch.uint8).numpy()
    raise ValueError(f"unknown input kind {kind!r}")


def to_cpu_arrays(value: Any, prefix: str, out: dict[str, np.ndarray]) -> None:
    """Every tensor/array in an output (dicts, lists, ModelOutput, dataclasses, ultralytics
    Results) as a float64/int numpy array keyed by its path: reading it is the app's download."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        out[prefix] = t.numpy() if t.dtype != torch.bfloat16 else t.float().numpy()
    elif isinstance(value, np.ndarray):
        out[prefix] = value
    elif isinstance(value, dict):
        for k, v in value.items():
            to_cpu_arrays(v, f"{prefix}.{k}", out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            to_cpu_arrays(v, f"{prefix}.{i}", out)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            to_cpu_arrays(getattr(value, f.name), f"{prefix}.{f.name}", out)
    elif type(value).__module__.startswith("ultralytics"):
        for name in ("boxes", "keypoints", "masks", "probs", "obb"):
            part = getattr(value, name, None)
            if part is not None:
                to_cpu_arrays(getattr(part, "data", part), f"{prefix}.{name}", out)
    elif isinstance(value, (int, float, bool)):
        out[prefix] = np.asarray(value)


def infer(model: Any, entry: dict[str, Any], x: Any) -> Any:
    call = entry.get("call", "forward")
    if call == "predict":  # ultralytics' own predictor: deep copy, fuse, letterbox, NMS
        return model.predict(x, imgsz=entry["imgsz"], verbose=False, device="cpu")
    if call == "generate":
        return model.generate(**x, **entry.get("generate", {}))
    if isinstance(x, dict):
        return model(**x)
    if isinstance(x, tuple):
        return model(*x)
    return model(x)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--entry", required=True, help="one models.yaml entry as JSON")
    p.add_argument("--dump", required=True)
    p.add_argument("--frames", type=int, default=6)
    p.add_argument("--window", type=int, default=0)
    args = p.parse_args(argv)
    entry = json.loads(args.entry)
    torch.set_num_threads(1)  # the machine is shared; and one thread sums in one order
    model = build(entry)
    net = model.model if entry["library"] == "ultralytics" and entry.get("call") != "predict" \
        else model
    if hasattr(net, "eval"):
        net.eval()
    if entry.get("script"):  # TorchScript: the interpreter calls the operators, not Python
        net = torch.jit.script(net)
    grad = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[
        entry.get("grad", "inference_mode")]
    arrays: dict[str, np.ndarray] = {}
    latencies = []
    for frame in range(args.frames):
        if args.window and frame == args.frames - args.window:
            print("MARK", flush=True)
            sys.stdin.readline()
        x = make_input(entry["input"], frame)
        start = time.perf_counter()
        with grad():
            y = infer(net, entry, x)
        inputs: dict[str, np.ndarray] = {}
        to_cpu_arrays(x, "x", inputs)
        input_bytes = sum(a.nbytes for a in inputs.values())
        frame_out: dict[str, np.ndarray] = {}
        to_cpu_arrays(y, f"f{frame}", frame_out)
        latencies.append(time.perf_counter() - start)
        arrays.update(frame_out)
    if args.window:
        print("MARK", flush=True)
        sys.stdin.readline()
    np.savez(args.dump, **arrays)
    steady = sorted(latencies[-max(1, args.window or 2):])
    print("RESULT " + json.dumps({"latency_s": steady[len(steady) // 2],
                                  "latencies_s": latencies, "input_bytes": input_bytes,
                                  "output_bytes": sum(a.nbytes for a in arrays.values())
                                  // args.frames}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
