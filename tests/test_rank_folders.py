"""The default disk folder of each rank when the optimizer is made before the process group is
initialized: the README's HF Trainer recipe under torchrun makes the optimizer before
``TrainingArguments`` (which initializes the group), so every rank chose ``disk_root`` itself
and all but one failed with "open in another process". A process a launcher started as rank *r*
(``RANK`` and ``WORLD_SIZE`` set, as torchrun and accelerate set them) uses ``rank{r}``; two
processes with no rank that share a folder are told what to do."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import torch
    from tierstore.optim import TieredAdamW
    root, ready, go = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    model = torch.nn.Linear(64, 64)
    try:
        opt = TieredAdamW(model.parameters(), offload="disk", disk_root=root)
    except Exception as error:
        ready.write_text(f"{type(error).__name__}: {error}")
        sys.exit(0)
    model.weight.grad, model.bias.grad = torch.ones(64, 64), torch.ones(64)
    opt.step()
    ready.write_text("made " + str(sorted(p.name for p in Path(root).iterdir())))
    deadline = time.monotonic() + 60
    while not go.exists() and time.monotonic() < deadline:  # (holds its folder until both made theirs)
        time.sleep(0.05)
    opt.close()
    """
)


def _two_processes(tmp_path: Path, ranks: list[dict[str, str]]) -> list[str]:
    root, go = tmp_path / "state", tmp_path / "go"
    children, readies = [], []
    for n, extra in enumerate(ranks):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        readies.append(tmp_path / f"ready{n}")
        children.append(subprocess.Popen([sys.executable, "-c", CHILD, str(root), str(readies[-1]), str(go)], env={**env, **extra}))
        deadline = time.monotonic() + 120
        while not readies[-1].exists() and time.monotonic() < deadline:  # (one after the other: the first holds its folder)
            time.sleep(0.05)
    go.write_text("")
    for child in children:
        assert child.wait(timeout=120) == 0
    return [ready.read_text() for ready in readies]


def test_ranks_started_by_a_launcher_use_their_own_folders_before_the_group_exists(tmp_path: Path) -> None:
    first, second = _two_processes(tmp_path, [{"RANK": "0", "WORLD_SIZE": "2"}, {"RANK": "1", "WORLD_SIZE": "2"}])
    assert first.startswith("made") and second.startswith("made"), (first, second)
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["rank0", "rank1"]


def test_two_processes_without_a_rank_on_one_folder_are_told_what_to_do(tmp_path: Path) -> None:
    first, second = _two_processes(tmp_path, [{}, {}])
    assert first.startswith("made")
    assert second.startswith("StoreLockedError") and "init_process_group" in second and "disk_root" in second, second
