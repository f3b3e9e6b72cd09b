"""Small compressed entries updated together (``tierstore.optim.batched.update_many``) give the
bits ``PackedState.update`` gives each one on its own."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch.optim.adam import adam

from tierstore.optim import TieredAdamW
from tierstore.optim.batched import BATCH_ELEMENTS, batched, update_many
from tierstore.optim.precision import TILE, PackedState, StateLayout

SIZES = [1, 7, 255, 256, 257, 1000, 4109, 300, 128, 9000]


def _adam_many(rows: list[list[torch.Tensor]], grads: list[torch.Tensor], steps: list[torch.Tensor], *, fused: bool, amsgrad: bool) -> None:
    adam([r[0] for r in rows], grads, [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows] if amsgrad else [], steps,
         foreach=not fused, fused=fused, amsgrad=amsgrad, beta1=0.9, beta2=0.99, lr=1e-2, weight_decay=0.1, eps=1e-8,
         maximize=False, decoupled_weight_decay=True)


def _entries(layout: StateLayout, sizes: list[int], seed: int) -> list[tuple[PackedState, torch.Tensor | None, torch.Tensor]]:
    """Entries of ``sizes`` elements with random state (the master the parameter's memory where
    the layout says so) and a step count each."""
    generator = torch.Generator().manual_seed(seed)
    made = []
    for n in sizes:
        master = torch.randn(n, generator=generator) if layout.param_master else None
        state = PackedState(layout, torch.zeros(layout.nbytes(n), dtype=torch.uint8), n, master=master)
        rows = torch.randn(layout.rows, n, generator=generator)
        rows[1:] *= 1e-3
        rows[2:] = rows[2:].abs()
        if layout.param_master:
            rows[0] = master  # type: ignore[index]
        state.encode(rows)
        made.append((state, master, torch.tensor(3.0)))
    return made


def _snapshot(entries: list[tuple[PackedState, torch.Tensor | None, torch.Tensor]]) -> list[tuple[torch.Tensor, ...]]:
    """Each entry's bytes, step count, master (the parameter's memory) and new weight (a
    lossless master's high halves), as bytes (a NaN equal to itself)."""
    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.detach().reshape(-1).view(torch.uint8).clone()

    return [(bits(state.buffer), bits(step), *(() if master is None else (bits(master),)), *(() if state.high is None else (bits(state.high),)))
            for state, master, step in entries]


def _gradients(sizes: list[int], step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(n, generator=generator) * 10.0 ** (step - 2) for n in sizes]
    grads[2][:] = 0  # an all-zero entry (its blocks' scale is clamped, not 0)
    grads[5][:256] = 0
    if step == 1:
        grads[3][17] = float("nan")  # one block of one entry lost, as one at a time
        grads[6][4100] = float("inf")
    return grads


@pytest.mark.parametrize(("precision", "master"), [(precision, master) for precision in ("bf16", "8bit") for master in ("stored", "parameter", "lossless")]
                         + [("fp32", "lossless")])  # (fp32 moments are packed only beside a lossless master)
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_together_gives_one_at_a_times_bits(precision: str, amsgrad: bool, master: str, fused: bool) -> None:
    layout = StateLayout(precision, master == "lossless", amsgrad, master == "parameter")
    alone, together = _entries(layout, SIZES, 0), _entries(layout, SIZES, 0)
    assert all(batched(state) for state, _, _ in together)
    math = partial(_adam_many, fused=fused, amsgrad=amsgrad)
    for step in range(3):
        grads = _gradients(SIZES, step)
        copies = [grad.clone() for grad in grads]  # (each side its own: a kernel may scale them in place)
        for (state, _, count), grad in zip(alone, grads, strict=True):
            state.update(grad, count, lambda rows, tile, c: math([rows], [tile], [c]))
        update_many([s for s, _, _ in together], copies, [c for _, _, c in together], math)
        for i, (a, b) in enumerate(zip(_snapshot(alone), _snapshot(together), strict=True)):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), (step, i)


def test_batches_of_many_entries_and_layouts() -> None:
    """More elements than one batch takes, and three layouts mixed in one call."""
    eight, bf16, lossless = StateLayout("8bit", False, False, True), StateLayout("bf16", False, False, False), StateLayout("8bit", True, False)
    sizes = [TILE, 40000, 30000, 300, TILE - 3, 5000]
    assert sum(sizes) > BATCH_ELEMENTS
    alone = _entries(eight, sizes, 1) + _entries(bf16, sizes, 2) + _entries(lossless, sizes, 3)
    together = _entries(eight, sizes, 1) + _entries(bf16, sizes, 2) + _entries(lossless, sizes, 3)
    order = [5, 0, 7, 3, 11, 14, 1, 2, 10, 17, 4, 6, 12, 9, 8, 13, 16, 15]  # (interleaved layouts)
    math = partial(_adam_many, fused=True, amsgrad=False)
    grads = [torch.randn(state.numel, generator=torch.Generator().manual_seed(i)) for i, (state, _, _) in enumerate(alone)]
    for (state, _, count), grad in zip(alone, grads, strict=True):
        state.update(grad, count, lambda rows, tile, c: math([rows], [tile], [c]))
    update_many([together[i][0] for i in order], [grads[i] for i in order], [together[i][2] for i in order], math)
    for a, b in zip(_snapshot(alone), _snapshot(together), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_math_that_fails_leaves_the_moments_and_counts() -> None:
    """(The math itself writes the master, here the parameter's memory, where it is, as one
    at a time.)"""
    layout = StateLayout("8bit", False, False, True)
    entries = _entries(layout, SIZES, 3)
    before = _snapshot(entries)

    def failing(rows: list[list[torch.Tensor]], grads: list[torch.Tensor], steps: list[torch.Tensor]) -> None:
        _adam_many(rows, grads, steps, fused=True, amsgrad=False)
        raise RuntimeError("the math failed")

    with pytest.raises(RuntimeError, match="the math failed"):
        update_many([s for s, _, _ in entries], _gradients(SIZES, 0), [c for _, _, c in entries], failing)
    after = _snapshot(entries)
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # (the master, the parameter's memory, is the math's to write)


def test_a_gradient_of_another_size_is_refused_before_anything_changes() -> None:
    layout = StateLayout("8bit", False, False, False)
    entries = _entries(layout, SIZES, 4)
    before = _snapshot(entries)
    grads = _gradients(SIZES, 0)
    grads[-1] = torch.zeros(SIZES[-1] + 1)
    with pytest.raises(ValueError, match="a gradient of 9001 elements for a state of 9000"):
        update_many([s for s, _, _ in entries], grads, [c for _, _, c in entries], partial(_adam_many, fused=True, amsgrad=False))
    assert all(torch.equal(x, y) for a, b in zip(before, _snapshot(entries), strict=True) for x, y in zip(a, b, strict=True))


def test_an_entry_given_twice_is_refused() -> None:
    """One at a time it would be updated twice; together, once: refused instead."""
    entries = _entries(StateLayout("8bit", False, False, True), [300, 300], 5)
    twice = [entries[0][0], entries[1][0], entries[0][0]]
    with pytest.raises(ValueError, match="given twice"):
        update_many(twice, _gradients([300, 300, 300, 300, 300, 300, 300], 0)[:3], [entries[0][2], entries[1][2], entries[0][2]],
                    partial(_adam_many, fused=True, amsgrad=False))


def test_a_lone_one_element_lossless_entry_gets_a_weight_of_its_own_memory() -> None:
    """Its new weight (the master's high halves) is a tensor whose bytes can be sent as they lie
    (a strided view of the batch's words could not be viewed as bytes)."""
    (state, _, step), = _entries(StateLayout("8bit", True, False), [1], 6)
    update_many([state], [torch.tensor([0.5])], [step], partial(_adam_many, fused=True, amsgrad=False))
    assert state.high is not None and state.high.stride() == (1,)
    assert state.high.view(torch.uint8).numel() == 2


@pytest.mark.device_modes
def test_a_one_element_gain_in_a_group_of_its_own(device_mode: str) -> None:
    """A bf16 model's lossless 8-bit state with a one-element parameter alone in its group (the
    new weight crosses the link as bytes)."""
    torch.manual_seed(0)
    linear, gain = torch.nn.Linear(8, 8).bfloat16(), torch.nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
    opt = TieredAdamW([{"params": linear.parameters()}, {"params": [gain]}], lr=1e-2, state_precision="8bit", master_weights="lossless")
    try:
        for _ in range(3):
            (linear(torch.randn(2, 8).bfloat16()) * gain).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        assert float(gain) < 1.0
    finally:
        opt.close()


def test_what_is_not_batched() -> None:
    """fp32 moments beside a master that is not lossless (kept as plain rows, not packed) and
    entries over a tile keep ``PackedState.update``."""
    def entry(layout: StateLayout, numel: int) -> PackedState:
        return PackedState(layout, torch.zeros(layout.nbytes(numel), dtype=torch.uint8), numel)

    assert batched(entry(StateLayout("8bit", False, False), 1000))
    assert batched(entry(StateLayout("8bit", True, False), 1000))
    assert not batched(entry(StateLayout("fp32", False, False), 1000))
    assert batched(entry(StateLayout("fp32", True, False), 1000))
    assert batched(entry(StateLayout("bf16", False, False), TILE))
    assert not batched(entry(StateLayout("bf16", False, False), TILE + 1))


@pytest.mark.device_modes
@pytest.mark.parametrize(("precision", "dtype", "master"), [("bf16", torch.float32, "fp32"), ("8bit", torch.float32, "fp32"),
                                                           ("8bit", torch.bfloat16, "lossless"),
                                                           ("fp32", torch.bfloat16, "lossless")])
def test_a_model_of_many_small_parameters_steps_as_with_a_group_each(device_mode: str, precision: str, dtype: torch.dtype, master: str) -> None:
    """Through ``TieredAdamW``: one group (its small entries updated together) and a group per
    parameter (each alone in its call) end bit for bit the same."""
    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        layers = [torch.nn.Sequential(torch.nn.Linear(24, 24), torch.nn.LayerNorm(24)) for _ in range(6)]
        return torch.nn.Sequential(*layers).to(dtype)

    one, each = model(), model()
    options = {"lr": 1e-2, "state_precision": precision, "master_weights": master, "offload": "host"}
    opts = [TieredAdamW(one.parameters(), **options), TieredAdamW([{"params": [p]} for p in each.parameters()], **options)]
    try:
        for seed in range(4):
            x = torch.randn(8, 24, generator=torch.Generator().manual_seed(seed)).to(dtype)
            for m, opt in zip((one, each), opts, strict=True):
                m(x).float().square().mean().backward()
                opt.step()
                opt.zero_grad()
        for a, b in zip(one.parameters(), each.parameters(), strict=True):
            assert torch.equal(a, b)
        state_one, state_each = opts[0].state_dict()["state"], opts[1].state_dict()["state"]
        for index, saved in state_one.items():
            for name, value in saved.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(state_each[index][name])), (index, name)
    finally:
        for opt in opts:
            opt.close()
