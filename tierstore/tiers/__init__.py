"""The tiers: ``DeviceTier``, ``HostTier`` and ``DiskTier``, and their bases."""

from .base import MemoryTier, Tier
from .disk import DiskTier
from .memory import DeviceTier, HostTier

__all__ = ["DeviceTier", "DiskTier", "HostTier", "MemoryTier", "Tier"]
