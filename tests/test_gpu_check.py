"""benchmarks/gpu_check.sh without a GPU and without a network: syntax, help, argument errors,
the requirements ``--prepare`` would download, and the refusal to run without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable, **(env or {})},
    )


def test_syntax_and_help() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    done = run("--help")
    assert done.returncode == 0
    for option in ("--prepare", "--wheels", "--out", "--allow-cpu", "--budget", "TIERSTORE_EMULATE_DEVICE"):
        assert option in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prepare"], "--prepare needs a folder"),
        (["--prepare", "/nonexistent/x", "--python-version", "twelve"], "--python-version takes 3.N"),
        (["--prepare", "/nonexistent/x", "--wheels", "/tmp"], "do not go together"),
        (["--wheels", "/nonexistent/wheels"], "is not a folder"),
        (["--budget", "soon"], "positive number of seconds"),
        (["--budget", "0"], "positive number of seconds"),
        (["--frobnicate"], "unknown argument"),
    ],
)
def test_bad_arguments_exit_2_with_a_reason(args: list[str], message: str) -> None:
    done = run(*args)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr


def test_prepare_asks_for_the_dependencies_less_torch_and_matplotlib() -> None:
    # The requirement list alone (the function --prepare feeds to pip download), no network.
    done = subprocess.run(
        ["bash", "-c", f'source <(sed -n "/^requirements() {{/,/^}}/p" {SCRIPT}); ROOT={ROOT}; PY={sys.executable}; requirements'],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    names = [line.split(">")[0].split("=")[0].strip() for line in done.stdout.split()]
    assert "torch" not in names and "matplotlib" not in names
    for needed in ("numpy", "zarr", "lmdb", "crc32c", "aiofiles", "tqdm", "psutil", "pytest", "pytest-asyncio", "hypothesis", "setuptools"):
        assert needed in names, names
    assert "ruff" not in names and "mypy" not in names


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_it_refuses_unless_allowed(tmp_path: Path) -> None:
    done = run("--out", str(tmp_path / "out"))
    assert done.returncode == 3
    assert "no CUDA" in done.stderr and "--allow-cpu" in done.stderr
    assert not (tmp_path / "out").exists()  # it stopped before doing anything
