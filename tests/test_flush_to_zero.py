"""8-bit moments under ``torch.set_flush_denormal(True)``: it sets the calling thread's
flush-to-zero alone, so the code book's search tables, once built with threaded fp32 ops on
subnormal values, came out mixed (a step then failed with an internal error); they are built in
float64 now (``precision.exact_values``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from tierstore.optim.precision import exact_values


def test_exact_values_decode_every_kind_of_fp32() -> None:
    generator = torch.Generator().manual_seed(0)
    bits = torch.cat([
        torch.randint(-(2**31), 2**31 - 1, (100_000,), dtype=torch.int64, generator=generator).to(torch.int32),
        torch.tensor([0, 1, 0x7FFFFF, 0x800000, 0x7F7FFFFF, 0x7F800000, 0x7FC00000, 0x7F800001], dtype=torch.int32),
    ])
    bits = torch.cat([bits, bits | torch.tensor(-(2**31), dtype=torch.int32)])  # (both signs)
    want = bits.view(torch.float32).double()  # (this thread does not flush: the conversion is exact)
    got = exact_values(bits)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan], want[~nan])
    assert torch.equal(torch.signbit(got[~nan]), torch.signbit(want[~nan]))  # (-0.0 stays -0.0)


def test_8bit_steps_with_flush_to_zero_set_after_torch_started_its_threads() -> None:
    if torch.get_num_threads() < 2:
        pytest.skip("one intra-op thread: no thread without flush-to-zero")
    script = textwrap.dedent("""
        import torch
        from tierstore.optim import TieredAdamW
        torch.randn(1 << 22).exp_().sum()  # (torch's intra-op threads start, without flush-to-zero)
        if not torch.set_flush_denormal(True):
            print("no flush-to-zero here")
            raise SystemExit(0)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(200, 300), torch.nn.GELU(), torch.nn.Linear(300, 7))
        opt = TieredAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, state_precision="8bit", min_offload_numel=1)
        try:
            for _ in range(2):
                model(torch.randn(16, 200)).square().mean().backward()
                opt.step()
                opt.zero_grad()
        finally:
            opt.close()
        print("stepped")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    if "no flush-to-zero here" in done.stdout:
        pytest.skip("this CPU cannot flush denormals")
    assert "stepped" in done.stdout
