"""The files a command writes (``--json``, ``--plot``), checked before it runs: a refusal after
minutes of work loses what the work made."""

from __future__ import annotations

import os
from pathlib import Path


def check_output_file(path: Path) -> None:
    """Make the folder ``path`` is written into, or raise ``ValueError`` saying why it cannot be."""
    if path.is_dir():
        raise ValueError(f"{path} is a folder; give the path of the file to write")
    blocking = next((p for p in (path.parent, *path.parent.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise ValueError(f"cannot write {path}: {blocking} is a file, not a folder")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot write {path}: {exc.strerror or exc} ({exc.filename or path.parent})") from None


def check_image_format(path: Path, option: str = "--plot") -> None:
    """``ValueError`` for a plot path whose suffix names no format matplotlib writes (matplotlib
    would only refuse it when the plot is drawn, after the work); ``ImportError`` without
    matplotlib."""
    from .plotting import pyplot

    pyplot()  # (without matplotlib: its clear ImportError, before the work)
    if not path.suffix:
        return  # (matplotlib's default format, PNG, and its suffix added)
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        raise ValueError(f"{option} {path}: matplotlib writes no {path.suffix!r} images; give a file ending in one of "
                         f"{', '.join('.' + name for name in sorted(formats))}")


def plot_file(path: Path) -> Path:
    """``path`` as matplotlib writes a plot there: one without a suffix gets its default
    format's (``mrc``: ``mrc.png``)."""
    if path.suffix:
        return path
    from .plotting import pyplot

    return path.with_name(f"{path.name.rstrip('.')}.{pyplot().rcParams['savefig.format']}")


def check_writable(path: Path, option: str) -> None:
    """``ValueError`` unless a file can be written at ``path`` (its folder exists: see
    ``check_output_file``): a file system that refuses it (``/proc``, read-only, no
    permission) said so only after the run. A file that was not there is not left behind."""
    existed = os.path.lexists(path)
    try:
        with open(path, "ab"):  # (appends nothing: a file there keeps its bytes)
            pass
    except OSError as exc:
        raise ValueError(f"{option} {path}: cannot write there ({exc.strerror or exc})") from None
    if not existed:
        path.unlink(missing_ok=True)
