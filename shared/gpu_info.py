"""The GPU a launcher's executors will run on, asked of NVML (the NVIDIA driver's management
library) rather than CUDA: the launcher runs no kernels, and a CUDA context there would hold
memory of the GPU its executors share out."""

import ctypes
import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GpuInfo:
    name: str  # as NVML reports it, e.g. "NVIDIA H200"
    total_memory: int  # bytes


class _Memory(ctypes.Structure):
    _fields_ = [
        ("total", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


def probe_gpu(device: str | None) -> GpuInfo | None:
    """The GPU ``device`` (``cuda``, ``cuda:N``, or None: the executors' default, CUDA where
    there is a GPU) names, through CUDA_VISIBLE_DEVICES as CUDA counts them; None for
    ``cpu``, or where NVML finds no such GPU (no NVIDIA driver, none visible)."""
    if device is not None and device.startswith("cpu"):
        return None
    index = int(device.partition(":")[2] or 0) if device else 0
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return None
    except (OSError, AttributeError):  # no driver, or one too old for these calls
        return None
    try:
        handle = _handle(nvml, index)
        if handle is None:
            return None
        name = ctypes.create_string_buffer(96)
        memory = _Memory()
        if nvml.nvmlDeviceGetName(handle, name, len(name)) != 0:
            return None
        if nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) != 0:
            return None
        return GpuInfo(name.value.decode(errors="replace"), memory.total)
    finally:
        nvml.nvmlShutdown()


def _handle(nvml: ctypes.CDLL, index: int) -> ctypes.c_void_p | None:
    """NVML's handle of CUDA's device ``index``: CUDA_VISIBLE_DEVICES lists NVML indices
    or UUIDs (GPU-..., MIG-...) in CUDA's order."""
    handle = ctypes.c_void_p()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        found = nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle))
        return handle if found == 0 else None
    entries = [entry.strip() for entry in visible.split(",")]
    if index >= len(entries) or not entries[index]:
        return None
    entry = entries[index]
    if entry.isdigit():
        found = nvml.nvmlDeviceGetHandleByIndex_v2(int(entry), ctypes.byref(handle))
    else:
        found = nvml.nvmlDeviceGetHandleByUUID(entry.encode(), ctypes.byref(handle))
    return handle if found == 0 else None
