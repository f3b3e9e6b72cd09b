"""Optimizers whose state is paged through a ``TierStore`` in time with the backward pass."""

from .adam import TieredAdam, TieredAdamW
from .generic import TieredOptimizer
from ..errors import StepIncompleteError
from .ddp import attach_ddp
from .paging import OptimizerCapacityError, PagedOptimizer
from .reports import MemoryReport, Timeline, TimeReport

__all__ = [
    "MemoryReport", "OptimizerCapacityError", "PagedOptimizer", "StepIncompleteError", "TieredAdam", "TieredAdamW",
    "TieredOptimizer", "TimeReport", "Timeline", "attach_ddp",
]
