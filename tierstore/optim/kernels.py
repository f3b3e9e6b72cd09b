"""Which of torch's Adam kernels a parameter group's update runs."""

from __future__ import annotations

from typing import Any


def uses_fused(group: dict[str, Any]) -> bool:
    """Whether a group's update runs torch's fused kernel: ``fused=`` where given, else unless
    ``foreach=`` asked for another kernel (``True``: foreach; ``False``: the for-loop, as
    torch's ``foreach=False`` means). Ours defaults to the fused kernel where torch's AdamW
    defaults to the for-loop (CPU) or foreach (CUDA) one."""
    fused = group.get("fused")
    return bool(fused) if fused is not None else group.get("foreach") is None
