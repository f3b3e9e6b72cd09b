"""The data files of a disk tier left open at interpreter exit.

Their descriptors were closed by their finalizer at exit, on the main thread, while jobs of the
store could still run on its daemon I/O threads: a trim of empty trailing segments raised
``IndexError: pop from empty list`` (printed at exit as a task exception never retrieved), and
a pending write could land in whatever file a later open got the same descriptor number. At
exit they are now left to the process's end; a ``SegmentFiles`` collected before still closes
its descriptors, and a removal of trailing files stops at files already closed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tierstore.disk.files import FileIO, SegmentFiles

SCRIPT = r"""
import gc, sys
from pathlib import Path
from tierstore.disk.files import FileIO, SegmentFiles

class Logged(FileIO):
    def close(self, fd):
        print("closed", flush=True)
        super().close(fd)

files = SegmentFiles(Path(sys.argv[1]), direct=False, staging_buffers=0, staging_size=0, pinned=False, io=Logged())
files.create(0, 4096)
if sys.argv[2] == "dropped":
    del files
    gc.collect()
print("exiting", flush=True)
"""


@pytest.mark.parametrize("how", ["left open", "dropped"])
def test_descriptors_are_closed_when_collected_not_at_exit(tmp_path: Path, how: str) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), how], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.split()
    assert lines[-1] == "exiting", done.stdout
    # (left open: the exit closed them under jobs that may still run; dropped: closed then)
    assert lines.count("closed") == (1 if how == "dropped" else 0), done.stdout


class _ClosingMidway(FileIO):
    """Closes every file of ``files`` the first time one is closed."""

    def __init__(self) -> None:
        self.files: SegmentFiles | None = None
        self.fired = False

    def close(self, fd: int) -> None:
        super().close(fd)
        if not self.fired and self.files is not None:
            self.fired = True
            self.files.close()


def test_remove_tail_stops_at_files_closed_meanwhile(tmp_path: Path) -> None:
    io = _ClosingMidway()
    files = SegmentFiles(tmp_path, direct=False, staging_buffers=0, staging_size=0, pinned=False, io=io)
    for segment in range(3):
        files.create(segment, 4096)
    io.files = files
    files.remove_tail(2)  # raised IndexError
    assert io.fired
    assert not files.path(2).exists()  # the one it removed before the others closed
    assert files.path(0).exists() and files.path(1).exists()  # segment 1 is left as a stray: never a live one
    files.close()


def test_remove_tail_of_open_files(tmp_path: Path) -> None:
    files = SegmentFiles(tmp_path, direct=False, staging_buffers=0, staging_size=0, pinned=False)
    for segment in range(3):
        files.create(segment, 4096)
    files.remove_tail(2)
    assert [path.name for path in sorted(tmp_path.iterdir())] == [files.path(0).name]
    files.create(1, 4096)  # the next segment is numbered after those left
    assert files.path(1).exists()
    files.close()
