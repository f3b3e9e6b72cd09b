"""The device boundary: links that copy between device and host memory (CUDA, an emulated
device on the CPU, or none), and the setting that chooses between them. See ``link.py``."""

from .link import READY, TO_DEVICE, TO_HOST, HostLink, Link, TransferListener
from .mode import ENV_EMULATE, ENV_LINK, emulate_device, emulation, link_for
from .spec import LinkSpec
from .transfer import Transfer, gather_transfers

__all__ = [
    "ENV_EMULATE",
    "ENV_LINK",
    "HostLink",
    "Link",
    "LinkSpec",
    "READY",
    "TO_DEVICE",
    "TO_HOST",
    "Transfer",
    "TransferListener",
    "emulate_device",
    "emulation",
    "gather_transfers",
    "link_for",
]
