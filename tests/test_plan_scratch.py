"""``memory_plan()`` counts the update's own buffers: compressed state is decoded tile by tile
into fp32 rows that each thread running updates keeps (up to 12 MiB a thread for 8-bit moments
on 1M-element tiles), and a lossless master's update makes the weight's new high halves. Before,
the plan's working set left them out (the README said so), so a plan sized to the byte was short
by tens of MiB with compressed state."""

from __future__ import annotations

import torch

from tierstore.optim import TieredAdamW, precision

MiB = 1 << 20


def _plan(precision_: str, master: str = "fp32", numel: int = 2_000_000):
    weight = torch.nn.Parameter(torch.zeros(numel, dtype=torch.bfloat16 if master == "lossless" else torch.float32))
    opt = TieredAdamW([weight], state_precision=precision_, master_weights=master, offload="host")
    try:
        return opt.memory_plan()
    finally:
        opt.close()


def test_compressed_state_counts_its_decoded_tiles_in_the_working_set() -> None:
    exact = _plan("fp32")
    for setting, rows in (("bf16", 3), ("8bit", 3)):
        plan = _plan(setting)
        extra = plan.working_bytes - exact.working_bytes
        # two threads run updates (the training thread, the optimizer's worker), each keeping
        # a tile of every decoded row: 256K-element tiles, or 1M where the compiled 8-bit codec runs
        assert 2 * rows * precision.UPDATE_TILE * 4 <= extra <= 2 * rows * precision.COMPILED_TILE * 4, (setting, extra)
        assert plan.process_bytes - exact.process_bytes >= extra - abs(plan.tier_capacity["host"] - exact.tier_capacity["host"])
        assert "working set" in str(plan)


def test_a_lossless_master_counts_the_new_weight_halves() -> None:
    numel = 1_000_000
    plan = _plan("fp32", "lossless", numel)
    entry = plan.chunk_bytes // 10 if plan.chunked_parameters else numel  # (10 B of state an element)
    # per thread: a tile of the rebuilt fp32 master, and the bf16 high halves of the whole entry
    assert plan.working_bytes == 2 * (min(entry, precision.UPDATE_TILE) * 4 + entry * 2)


def test_plain_fp32_state_adds_nothing() -> None:
    """fp32 moments are updated where they lie: no buffer of the update's own."""
    assert _plan("fp32").working_bytes == 0
