"""Device and dtype names."""

from __future__ import annotations

import pytest
import torch

from loom.model.device import available_memory, resolve_device, resolve_dtype

CPU = torch.device("cpu")


def test_device_auto_is_cuda_only_when_present() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected


def test_device_rejects_unknown_and_absent_devices() -> None:
    with pytest.raises(ValueError, match="device must be auto, cpu or cuda"):
        resolve_device("mps")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            resolve_device("cuda")


def test_device_refuses_a_gpu_index_past_the_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """`cuda:N` with N at or past torch's GPU count is refused by name, not left to fail at the
    first allocation (the count is torch's; on a machine with no GPU, two are pretended)."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    count = torch.cuda.device_count()
    assert resolve_device(f"cuda:{count - 1}").index == count - 1
    with pytest.raises(ValueError, match=rf"'cuda:{count}': torch sees {count} GPU"):
        resolve_device(f"cuda:{count}")


def test_dtype_auto_is_float32_on_cpu_and_names_resolve() -> None:
    assert resolve_dtype("auto", CPU) is torch.float32
    assert resolve_dtype("bf16", CPU) is torch.bfloat16
    assert resolve_dtype("float32", CPU) is torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16


def test_dtype_float16_is_cuda_only_and_unknown_names_are_rejected() -> None:
    with pytest.raises(ValueError, match="float16 is supported on cuda only"):
        resolve_dtype("fp16", CPU)
    assert resolve_dtype("fp16", torch.device("cuda")) is torch.float16
    with pytest.raises(ValueError, match="dtype must be auto or one of"):
        resolve_dtype("int8", CPU)


def test_available_memory_is_positive_on_cpu() -> None:
    assert available_memory(CPU) > 0
