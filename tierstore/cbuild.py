"""Building the package's small C files (``optim/adam8.c``, ``disk/crc32c.c``) at first use.

Each is compiled with the system's C compiler (``$CC``, else ``cc``/``gcc``/``clang``), loaded
through ``ctypes`` (whose calls let the GIL go) and kept in ``$XDG_CACHE_HOME/tierstore`` (else
``~/.cache/tierstore``) for the next processes. A kept build is named by a digest of the source,
the compiler command and this CPU's model and flags, so a changed source, compiler or machine
(a home folder shared between hosts) builds anew instead of loading code the CPU may not run.
Callers fall back to their pure-Python/torch twin (same results) where a build fails.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path


def compiler() -> list[str] | None:
    """The C compiler's command: ``$CC`` where set (it may carry words: ``ccache gcc``; one that
    does not run fails the build), else the first of ``cc``, ``gcc``, ``clang`` found."""
    given = shlex.split(os.environ.get("CC", ""))
    if given:
        return given
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return [name]
    return None


def cpu_identity() -> str:
    """This CPU's model name and feature flags (Linux's ``/proc/cpuinfo``; elsewhere the platform's
    processor string)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            lines = [line.strip() for line in info if line.startswith(("model name", "flags"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def cpu_flags() -> set[str]:
    """This CPU's feature flags (``avx512f``, ``vpclmulqdq``, ...); empty where not known."""
    for line in cpu_identity().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def build(source: Path, flags: Sequence[str], *, optional: Sequence[str] = ()) -> ctypes.CDLL:
    """``source`` compiled as a shared library with ``flags`` (and ``optional``, left out where the
    compiler refuses them), from the user's cache folder where this machine built it before.
    Raises ``RuntimeError`` (with the compiler's message) where it cannot be built."""
    command = compiler()
    if command is None:
        raise RuntimeError("no C compiler found (set CC)")
    cached = _cache_file(source, [*command, *flags, *optional])
    try:
        return ctypes.CDLL(str(cached))
    except OSError:  # (none yet, or unusable: built again)
        pass
    folder = tempfile.mkdtemp(prefix=f"tierstore-{source.stem}-")
    try:
        library = Path(folder) / f"{source.stem}.so"
        attempts = [[*command, *flags, *optional], [*command, *flags]] if optional else [[*command, *flags]]
        for line in attempts:
            full = [*line, "-o", str(library), str(source)]
            try:
                done = subprocess.run(full, capture_output=True, text=True, timeout=120)
            except (OSError, subprocess.SubprocessError) as exc:  # (not found, not executable, hung)
                raise RuntimeError(f"{' '.join(full)} failed: {exc}") from None
            if done.returncode == 0:
                break
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip()[-500:]
            raise RuntimeError(f"{' '.join(full)} failed (exit status {done.returncode}){': ' + said if said else ', with no message'}")
        compiled = ctypes.CDLL(str(library))  # (the mapping outlives the file)
        _keep(library, cached)
        return compiled
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _cache_file(source: Path, command: list[str]) -> Path:
    key = hashlib.sha256(source.read_bytes() + repr((command, platform.machine(), cpu_identity())).encode()).hexdigest()[:20]
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "tierstore" / f"{source.stem}-{key}.so"


def _keep(library: Path, cached: Path) -> None:
    """Best effort: a folder that cannot be written only means the next process builds again."""
    try:
        cached.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        partial = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
        shutil.copyfile(library, partial)
        os.replace(partial, cached)  # (whole or absent: a reader never loads half a file)
    except OSError:
        pass
