"""Which link a device gets: CUDA, the emulated device, or none (plain CPU).

``TIERSTORE_EMULATE_DEVICE=1`` makes CPU tensors of the model count as device memory behind an
``EmulatedLink``; ``TIERSTORE_EMULATE_LINK="25GB/s,10us"`` sets its speed. In Python, the same
with ``emulate_device()`` (process-wide; also a context manager that restores the previous
setting), or per object with the ``emulate_device=`` argument of ``TieredAdamW``, the swap
functions and ``DeviceTier``.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

from ..flags import require_flag
from .link import HostLink, Link
from .spec import LinkSpec

ENV_EMULATE = "TIERSTORE_EMULATE_DEVICE"
ENV_LINK = "TIERSTORE_EMULATE_LINK"

_lock = threading.Lock()
_override: tuple[bool, LinkSpec] | None = None
_links: dict[Any, Link] = {}


def _from_env() -> tuple[bool, LinkSpec]:
    raw = os.environ.get(ENV_EMULATE, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        enabled = False
    elif raw in ("1", "true", "yes", "on"):
        enabled = True
    else:
        raise ValueError(f"{ENV_EMULATE}={raw!r}: use 1 or 0")
    return enabled, LinkSpec.parse(os.environ.get(ENV_LINK, ""))


def emulation() -> tuple[bool, LinkSpec]:
    """``(enabled, link spec)`` now: ``emulate_device()``'s setting, else the environment's."""
    with _lock:
        if _override is not None:
            return _override
    return _from_env()


class _Setting:
    """What ``emulate_device()`` returns: already applied; as a context manager, undone on exit."""

    def __init__(self, previous: tuple[bool, LinkSpec] | None) -> None:
        self._previous = previous

    def __enter__(self) -> _Setting:
        return self

    def __exit__(self, *exc_info: object) -> None:
        global _override
        with _lock:
            _override = self._previous


def emulate_device(enabled: bool = True, link: str | LinkSpec | None = None) -> _Setting:
    """Emulate a device on the CPU (or stop, with ``enabled=False``) for objects made from now on,
    overriding ``TIERSTORE_EMULATE_DEVICE``; ``link`` sets bandwidth and latency, e.g.
    ``"25GB/s,10us"`` (default: ``TIERSTORE_EMULATE_LINK``, else memcpy speed). Use it as a plain
    call or as ``with emulate_device(): ...`` to restore the previous setting afterwards."""
    global _override
    spec = link if isinstance(link, LinkSpec) else LinkSpec.parse(link) if link is not None else _from_env()[1]
    with _lock:
        previous = _override
        _override = (require_flag("enabled", enabled), spec)
    return _Setting(previous)


def link_for(device: torch.device | str, emulate: bool | None = None, spec: LinkSpec | str | None = None) -> Link:
    """The link between ``device`` and host memory: a ``CudaLink`` for CUDA; for the CPU an
    ``EmulatedLink`` when emulating (``emulate``, else the process setting), else a ``HostLink``
    (no boundary). Links are shared: one per device and speed, as a GPU has one set of copy
    engines."""
    device = torch.device(device)
    if device.type == "cuda":
        from .cuda import CudaLink

        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return _shared(("cuda", device.index), lambda: CudaLink(device))
    if device.type != "cpu":
        raise ValueError(f"no link for device {device} (cpu and cuda only)")
    enabled, default_spec = emulation()
    if emulate is not None:
        enabled = bool(emulate)
    if not enabled:
        return _shared(("host",), lambda: HostLink(torch.device("cpu")))
    link_spec = spec if isinstance(spec, LinkSpec) else LinkSpec.parse(spec) if spec is not None else default_spec
    from .emulated import EmulatedLink

    return _shared(("emulated", link_spec), lambda: EmulatedLink(link_spec))


def _shared(key: Any, make: Any) -> Link:
    with _lock:
        link = _links.get(key)
        if link is None:
            link = _links[key] = make()
        return link


