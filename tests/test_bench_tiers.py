"""bench_tiers' disk cells: the second baseline (DeepSpeed's AIO op where installed) is
measured beside ours on the same buffers and reported per cell."""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from tierstore.bench.tiers import measure_disk
from tierstore.tensors import aligned_empty

MiB = 1 << 20


class FakeAIO:
    """Stands in for ``DeepSpeedAIO`` (deepspeed is not a dependency): plain files, and a log of
    which buffers it was handed."""

    settings = {"block": MiB}

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.given: list[torch.Tensor] = []
        self.moved: set[int] = set()
        self.freed = False

    def buffers(self, count: int, numel: int) -> list[torch.Tensor]:
        self.given = [aligned_empty(numel * 4).view(torch.float32)[:numel] for _ in range(count)]
        return self.given

    def free(self, buffers: list[torch.Tensor]) -> None:
        self.freed = all(a is b for a, b in zip(buffers, self.given, strict=True))

    def prepare(self, buffers: list[torch.Tensor]) -> None:
        for index, buffer in enumerate(buffers):
            self.write(buffer, index, fsync=False)

    def write(self, buffer: torch.Tensor, index: int, fsync: bool) -> None:
        self.moved.add(buffer.data_ptr())
        (self.folder / f"fake-{index}.bin").write_bytes(buffer.numpy().tobytes())

    def read(self, buffer: torch.Tensor, index: int) -> None:
        data = (self.folder / f"fake-{index}.bin").read_bytes()
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def close(self, count: int) -> None:
        for index in range(count):
            (self.folder / f"fake-{index}.bin").unlink(missing_ok=True)


async def test_the_second_baseline_moves_the_same_buffers_and_each_cell_reports_it(tmp_path: Path) -> None:
    fake = FakeAIO(tmp_path)
    with tqdm(disable=True) as progress:
        rows = await measure_disk(tmp_path, 4 * MiB, count=2, reps=1, durable=True, progress=progress, deepspeed=fake)
    assert fake.moved == {buffer.data_ptr() for buffer in fake.given}  # the buffers ours and raw use
    assert fake.freed
    goal_rows = [row for row in rows if row["goal_cell"]]
    assert {row["what"] for row in goal_rows} == {"disk put (durable)", "disk put, 4 in flight (durable)", "disk get (into out=)", "disk get, 4 in flight"}
    for row in rows:
        assert row["deepspeed_gbs"] > 0 and row["ratio_deepspeed"] > 0
    assert not list(tmp_path.glob("fake-*.bin"))
