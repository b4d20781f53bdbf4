"""Where the model runs and in what precision: `auto`, `cpu`, `cuda` and the dtype names."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_device(name: str) -> torch.device:
    """`auto` is cuda when a GPU is present, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:  # not a device name torch knows
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but torch sees no CUDA GPU")
    if device.index is not None and device.type == "cuda":
        count = torch.cuda.device_count()
        if device.index >= count:
            raise ValueError(
                f"device {name!r}: torch sees {count} GPU(s), cuda:0 to cuda:{count - 1}"
            )
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is float32 on cpu (bf16 matmuls are slower without AMX) and bfloat16 on cuda."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = DTYPES.get(name)
    if dtype is None:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {name!r}")
    if dtype is torch.float16 and device.type != "cuda":
        raise ValueError("dtype float16 is supported on cuda only; use float32 or bfloat16 on cpu")
    return dtype


def available_memory(device: torch.device) -> int:
    """Bytes free for new allocations on the device right now."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def used_memory(device: torch.device) -> int:
    """Bytes this process holds on the device: a GPU's allocated by torch, else the process's
    resident memory."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def release_freed_memory() -> None:
    """Return the heap's freed pages to the system, where the C library is glibc (which keeps
    them otherwise): what loading freed, the float weights q4 packed into blocks above all."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)
