"""The compiled 8-bit codec on an entry whose byte size is no multiple of 4 (8-bit state with
amsgrad of 70,001 elements: 213,291 bytes): inductor rebuilt the fp32 scales' view from the
entry's uint8 storage and failed an internal assertion (``nbytes % dtype_size == 0``), which
turned the compiled codec off for the rest of the process (a warning, then the slower eager
one). Run in a process of its own with an empty inductor cache: a cached kernel hides it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CODE = textwrap.dedent(
    """
    import warnings
    import torch
    from tierstore.optim import precision as codec
    warnings.simplefilter("ignore", DeprecationWarning)
    numel = 70_001
    layout = codec.StateLayout("8bit", False, True, param_master=True)
    assert layout.nbytes(numel) % 4, layout.nbytes(numel)
    fields = layout.fields(numel)
    entry = layout.empty(numel)

    def view(name):
        field = fields[name]
        return entry[field.offset : field.offset + field.nbytes].view(field.dtype)

    values = torch.randn(numel).square()
    codec.quantize(values, False, view("exp_avg_sq/codes"), view("exp_avg_sq/scale"), compiled=True)
    codes, scales = torch.empty(numel, dtype=torch.uint8), torch.empty(view("exp_avg_sq/scale").numel())
    codec.quantize(values, False, codes, scales, compiled=False)
    print("compiled failed:", codec._COMPILED.failed)
    print("same as eager:", torch.equal(view("exp_avg_sq/codes"), codes) and torch.equal(view("exp_avg_sq/scale"), scales))
    """
)


def test_the_compiled_codec_works_on_an_entry_of_an_odd_byte_size(tmp_path: Path) -> None:
    if not any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++")):
        pytest.skip("no compiler for the compiled codec here")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TIERSTORE_COMPILE_CODEC": "1"}
    result = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "compiled failed: False" in result.stdout, result.stderr[-3000:]
    assert "same as eager: True" in result.stdout
    assert "unavailable" not in result.stderr, result.stderr[-3000:]
