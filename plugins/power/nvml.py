"""``nvml``: NVIDIA GPU board energy from NVML's energy counter.

What it reads: ``nvmlDeviceGetTotalEnergyConsumption`` for every visible GPU (or the ``devices``
given): the board's energy in millijoules since the driver was loaded, Volta and newer. It is the
most precise GPU figure there is, but it covers the GPU board only, not the CPU or the rest of
the machine.

Bindings, both optional and imported only when the meter is probed or built (a robot without
NVIDIA hardware must not pay for, or fail on, the import): cuda-python's ``cuda.bindings.nvml``
(``pip install rrtod[nvml]``), else nvidia-ml-py's ``pynvml``. Both wrap the same C call and
raise on error; the two spellings are hidden behind ``NvmlApi``.

Probe reasons: bindings not installed; no NVIDIA driver (libnvidia-ml missing or the kernel
module not loaded); no GPU; a GPU without the energy counter (pre-Volta). The counter restarts
when the driver reloads; a read that sees it go down counts from the new zero.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

from rrto_plugins.power.base import MeterBase, MeterUnavailable

# NVML return codes (nvml.h) the reasons distinguish.
_NOT_SUPPORTED, _NO_PERMISSION, _DRIVER_NOT_LOADED, _LIBRARY_NOT_FOUND = 3, 4, 9, 12


class NvmlApi(Protocol):
    """The four NVML calls the meter needs, whichever binding provides them."""

    name: str

    def init(self) -> None: ...
    def count(self) -> int: ...
    def handle(self, index: int) -> Any: ...
    def energy_mj(self, handle: Any) -> int: ...


class _CudaBindings:
    name = "cuda.bindings.nvml"

    def __init__(self, module: Any):
        self._m = module

    def init(self) -> None:
        self._m.init_v2()

    def count(self) -> int:
        return int(self._m.device_get_count_v2())

    def handle(self, index: int) -> Any:
        return self._m.device_get_handle_by_index_v2(index)

    def energy_mj(self, handle: Any) -> int:
        return int(self._m.device_get_total_energy_consumption(handle))


class _Pynvml:
    name = "pynvml"

    def __init__(self, module: Any):
        self._m = module

    def init(self) -> None:
        self._m.nvmlInit()

    def count(self) -> int:
        return int(self._m.nvmlDeviceGetCount())

    def handle(self, index: int) -> Any:
        return self._m.nvmlDeviceGetHandleByIndex(index)

    def energy_mj(self, handle: Any) -> int:
        return int(self._m.nvmlDeviceGetTotalEnergyConsumption(handle))


def load_api(importer: Any = importlib.import_module) -> NvmlApi:
    """The first binding that imports, else MeterUnavailable("... not installed")."""
    for module, wrapper in (("cuda.bindings.nvml", _CudaBindings), ("pynvml", _Pynvml)):
        try:
            return wrapper(importer(module))
        except ImportError:
            continue
    raise MeterUnavailable(
        "NVML bindings not installed (pip install 'rrtod[nvml]' for cuda-python, or nvidia-ml-py)"
    )


def reason(exc: BaseException, what: str) -> str:
    """An operator's reading of an NVML error raised while doing ``what``."""
    code = getattr(exc, "value", None)  # pynvml's NVMLError
    if not isinstance(code, int):
        code = getattr(exc, "status", None)  # cuda.bindings' NvmlError
    text = f"{type(exc).__name__}: {exc}"
    lowered = text.lower()
    if code in (_DRIVER_NOT_LOADED, _LIBRARY_NOT_FOUND) or any(
        k in lowered for k in ("driver", "library", "libnvidia-ml", "not found")
    ):
        return f"no NVIDIA driver ({what}: {text})"
    if code == _NOT_SUPPORTED or "notsupported" in lowered.replace(" ", "").replace("_", ""):
        return f"GPU has no energy counter; needs Volta or newer ({what}: {text})"
    if code == _NO_PERMISSION or "permission" in lowered:
        return f"no permission to query the GPU ({what}: {text})"
    return f"NVML failed ({what}: {text})"


class NvmlMeter(MeterBase):
    """Summed GPU energy counters, in joules since construction.

    ``api`` is injectable (tests pass a fake; default: the installed binding). ``devices``
    selects NVML indices; default all.
    """

    blocking = True  # a driver call: may take milliseconds while the GPU is busy

    def __init__(self, api: NvmlApi | None = None, devices: list[int] | None = None):
        self._api = api if api is not None else load_api()
        try:
            self._api.init()
        except Exception as exc:
            raise MeterUnavailable(reason(exc, "init")) from None
        try:
            indices = devices if devices is not None else list(range(self._api.count()))
        except Exception as exc:
            raise MeterUnavailable(reason(exc, "device count")) from None
        if not indices:
            raise MeterUnavailable("no NVIDIA GPU visible to NVML")
        self._handles: list[Any] = []
        self._last: list[int] = []
        for index in indices:
            try:
                handle = self._api.handle(index)
                self._last.append(self._api.energy_mj(handle))
            except Exception as exc:
                raise MeterUnavailable(reason(exc, f"GPU {index}")) from None
            self._handles.append(handle)
        self.devices = indices
        self._total_mj = 0

    @staticmethod
    def probe(api: NvmlApi | None = None) -> str | None:
        try:
            NvmlMeter(api)
        except MeterUnavailable as exc:
            return str(exc)
        return None

    def read(self) -> float:
        values = [self._api.energy_mj(h) for h in self._handles]
        for i, value in enumerate(values):
            last = self._last[i]
            self._total_mj += value - last if value >= last else value  # driver reload: from 0
            self._last[i] = value
        return self._total_mj / 1e3

    def describe(self) -> dict[str, Any]:
        return {"kind": "nvml", "binding": self._api.name, "devices": self.devices}
