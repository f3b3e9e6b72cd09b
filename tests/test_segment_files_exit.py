"""Trailing segment files removed while the interpreter's exit closes them.

A store left open at exit has its data files closed by their finalizer, on the main thread,
while a trim of empty trailing segments may be running on an I/O thread. That trim raised
``IndexError: pop from empty list`` (printed at exit as a task exception never retrieved) when
the files were closed between its checks; it must stop quietly and leave the files it did not
get to as strays, which the next open deletes.
"""

from __future__ import annotations

from pathlib import Path

from tierstore.disk.files import FileIO, SegmentFiles


class _ClosingMidway(FileIO):
    """Closes every file of ``files`` (as the exit finalizer does) the first time one is closed."""

    def __init__(self) -> None:
        self.files: SegmentFiles | None = None
        self.fired = False

    def close(self, fd: int) -> None:
        super().close(fd)
        if not self.fired and self.files is not None:
            self.fired = True
            self.files.close()


def test_remove_tail_stops_when_the_files_close_meanwhile(tmp_path: Path) -> None:
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
