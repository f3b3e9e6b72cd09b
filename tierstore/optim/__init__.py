"""Optimizers whose state is paged through a ``TierStore`` in time with the backward pass."""

from ..errors import StepIncompleteError
from .adam import TieredAdam, TieredAdamW
from .dcp import (
    StreamingFileSystemWriter,
    StreamingLoadPlanner,
    StreamingSavePlanner,
    load_optimizer,
    optimizer_state_dict,
    save_optimizer,
)
from .ddp import attach_ddp, average_as_ddp
from .generic import TieredOptimizer
from .paging import OptimizerCapacityError, PagedOptimizer
from .reports import MemoryReport, Timeline, TimeReport

__all__ = [
    "MemoryReport", "OptimizerCapacityError", "PagedOptimizer", "StepIncompleteError", "StreamingFileSystemWriter",
    "StreamingLoadPlanner", "StreamingSavePlanner", "TieredAdam", "TieredAdamW", "TieredOptimizer", "TimeReport", "Timeline",
    "attach_ddp", "average_as_ddp", "load_optimizer", "optimizer_state_dict", "save_optimizer",
]
