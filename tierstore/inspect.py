"""What a disk tier folder holds, read without opening a store (``tierstore info``)."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import Any

from .disk.catalog import Catalog
from .errors import CatalogError
from .units import format_bytes


def describe_folder(root: str | Path) -> dict[str, Any]:
    """Entries (key, dtype, shape, bytes), totals and free space of the disk tier at ``root``.

    Reads the catalog read-only, so it works while another process has the folder open.
    """
    root = Path(root)
    if not (root / "catalog").is_dir():
        raise CatalogError(f"{root} is not a tierstore disk folder (no catalog/ inside)")
    catalog = Catalog(root / "catalog", durable=False)
    layout = catalog.open_readonly()
    try:
        records = [record for _, record in catalog.records()]
    finally:
        catalog.close()
    records.sort(key=lambda r: r.key)
    reserved = sum(layout.segments)
    used = sum(r.extent.length for r in records)
    disk = shutil.disk_usage(root)
    return {
        "root": str(root.resolve()),
        "entries": len(records),
        "tensor_bytes": sum(r.meta.nbytes for r in records),
        "extent_bytes": used,
        "segments": len(layout.segments),
        "reserved_bytes": reserved,
        "free_in_segments": reserved - used,
        "filesystem_free": disk.free,
        "chunk_size": layout.chunk_size,
        "dtypes": dict(Counter(str(r.meta.dtype).removeprefix("torch.") for r in records)),
        "keys": [
            {
                "key": r.key,
                "dtype": str(r.meta.dtype).removeprefix("torch."),
                "shape": list(r.meta.shape),
                "nbytes": r.meta.nbytes,
                "version": r.version,
            }
            for r in records
        ],
    }


def format_description(info: dict[str, Any], limit: int | None = 40) -> str:
    """A short human-readable report of ``describe_folder``'s result."""
    lines = [
        f"{info['root']}",
        f"  {info['entries']} entries, {format_bytes(info['tensor_bytes'])} of tensors "
        f"in {info['segments']} segment file(s) of {format_bytes(info['reserved_bytes'])} "
        f"({format_bytes(info['free_in_segments'])} free inside them)",
        f"  file system free: {format_bytes(info['filesystem_free'])}",
    ]
    if info["dtypes"]:
        lines.append("  dtypes: " + ", ".join(f"{name} x{n}" for name, n in sorted(info["dtypes"].items())))
    keys = info["keys"] if limit is None else info["keys"][:limit]
    if keys:
        width = min(60, max(len(repr(k["key"])) for k in keys))
        lines.append("")
        lines.append(f"  {'key':<{width}}  {'dtype':<14} {'shape':<20} {'size':>10}")
        for k in keys:
            shape = "x".join(map(str, k["shape"])) or "scalar"
            name = repr(k["key"])
            name = name if len(name) <= width else name[: width - 3] + "..."
            lines.append(f"  {name:<{width}}  {k['dtype']:<14} {shape:<20} {format_bytes(k['nbytes']):>10}")
        hidden = len(info["keys"]) - len(keys)
        if hidden > 0:
            lines.append(f"  ... and {hidden} more (--all to list them)")
    return "\n".join(lines)
