"""Which ops in a stretch of torch code make the host wait for the device: a TorchDispatchMode
that records every op the device must finish before the host can go on (a value read back: a
tensor's `.item()`, `.tolist()` or a copy to the CPU; an output whose size depends on the
data: `nonzero`, boolean indexing, `masked_select`) and every copy from the host into the
device (pageable memory: the host waits for it too).

On a CPU-only run the ops are recorded all the same (their tensors are all on the CPU); what
is a sync on a GPU is the op, not the device."""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
READ_BACK = {aten._local_scalar_dense.default, aten.item.default}
DATA_SIZED = {aten.nonzero.default, aten.masked_select.default, aten.unique_consecutive.default}
DATA_SIZED |= {aten._unique2.default, aten.repeat_interleave.Tensor}


class SyncAudit(TorchDispatchMode):
    """`with SyncAudit() as audit: ...`; then `audit.ops` counts each syncing op by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = syncing(func, args, kwargs)
        if name is not None:
            self.ops[name] += 1
        return func(*args, **kwargs)


def syncing(func: Any, args: Any, kwargs: dict[str, Any]) -> str | None:
    if func in READ_BACK or func in DATA_SIZED:
        return str(func.overloadpacket.__name__)
    if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(i is not None and i.dtype == torch.bool for i in indices):
            return "boolean index"
    if func in (aten._to_copy.default, aten.copy_.default):
        source = args[1] if func is aten.copy_.default else args[0]
        target = args[0].device if func is aten.copy_.default else kwargs.get("device")
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        if isinstance(source, torch.Tensor) and target is not None:
            if source.is_pinned() and non_blocking:
                return None  # asynchronous: the host goes on
            if source.device.type == "cpu" and torch.device(target).type == "cuda":
                return "host-to-device copy"
            if source.device.type == "cuda" and torch.device(target).type == "cpu":
                return "device-to-host copy"
    return None
