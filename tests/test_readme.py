"""Every ```python block of README.md runs as written.

Each block runs in a fresh interpreter in a temporary folder (so relative paths such as
``"ts-data"`` land there). Only two things are substituted: the device (``"cuda:0"`` and
``"cuda"`` become ``"cpu"`` where there is no GPU) and absolute folders (``/nvme/...`` become
folders under the temporary one). Blocks that use a ``model`` and its ``data``, which the README
leaves to the reader, get ``PREAMBLE`` in front: a tiny model whose call returns its loss, and
three batches. The preamble imports nothing into the block's namespace, so a block
missing ``import torch`` still fails.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
import torch

from tierstore.optim.distributed import free_port

README = Path(__file__).resolve().parents[1] / "README.md"

PREAMBLE = '''
def _model_and_data():  # imports stay inside: the block must import what it uses itself
    import torch

    class TinyModel(torch.nn.Module):  # model(batch) returns the loss, as in the README
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

        def forward(self, batch):
            return self.second(torch.relu(self.first(batch))).square().mean()

    return TinyModel(), [torch.randn(8, 64) for _ in range(3)]

model, data = _model_and_data()
'''


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, code) of every ```python block."""
    return [(text[: m.start()].count("\n") + 2, m.group(1)) for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]


def prepared(code: str, folder: Path) -> str:
    if not torch.cuda.is_available():
        code = re.sub(r"""(["'])cuda(:\d+)?\1""", r"\1cpu\1", code)
    code = re.sub(r"""(["'])/nvme/""", lambda m: f"{m.group(1)}{folder}/nvme/", code)
    return (PREAMBLE if _uses_model_or_data(code) else "") + code


def _uses_model_or_data(code: str) -> bool:
    """Whether the first use of the name ``model`` or ``data`` reads it (is not ``name = ...``)."""
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(code).readline) if t.type in (tokenize.NAME, tokenize.OP)]
    for n, token in enumerate(tokens):
        if token.type == tokenize.NAME and token.string in ("model", "data"):
            return not (n + 1 < len(tokens) and tokens[n + 1].string == "=")
    return False


BLOCKS = python_blocks(README.read_text())


def test_the_readme_has_python_blocks() -> None:
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize(("line", "code"), BLOCKS, ids=[f"line{line}" for line, _ in BLOCKS])
def test_a_readme_block_runs_as_written(line: int, code: str, tmp_path: Path) -> None:
    script = prepared(code, tmp_path)
    env = dict(os.environ)
    if "init_process_group" in code:  # a block written for torchrun runs as a job of one rank
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, f"README.md block at line {line} failed:\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-3000:]



def test_substitutions_touch_only_devices_and_folders(tmp_path: Path) -> None:
    code = 'DeviceTier("cuda:0", "8GiB"); DiskTier("/nvme/ts", "1TiB"); x.to("cuda")'
    out = prepared(code, tmp_path)
    assert f'DiskTier("{tmp_path}/nvme/ts", "1TiB")' in out
    if not torch.cuda.is_available():
        assert 'DeviceTier("cpu", "8GiB")' in out and 'x.to("cpu")' in out


def test_readme_disk_tiers_fit_a_small_disk() -> None:
    """A disk tier's capacity is checked against the file system's free space when it opens, and
    CI's machine has about 15 GiB free: a README block asking for more fails there only."""
    units = {"MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    for line, code in BLOCKS:
        for number, unit in re.findall(r"""DiskTier\([^,]+,\s*["'](\d+)(MiB|GiB|TiB)["']""", code):
            assert int(number) * units[unit] <= 4 * 2**30, f"README.md block at line {line} asks for a {number}{unit} disk tier"
