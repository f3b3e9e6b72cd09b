"""Compressed Adam state (``state_precision="bf16"``/``"8bit"``) and the lossless master
(``master_weights="lossless"``), against references written plainly here: torch's AdamW whose
moments are replaced after every step by what the stored form keeps of them, and a plain loop
with an fp32 master whose bf16 weight is its truncation."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from tierstore import DiskTier, HostTier, SyncTierStore
from tierstore.optim import TieredAdamW
from tierstore.optim.precision import SMALLEST_SCALE, dynamic_map

pytestmark = pytest.mark.device_modes


# -- the reference: what the stored form keeps of a moment, written plainly ---------------------


def _kept_8bit(values: torch.Tensor, signed: bool) -> torch.Tensor:
    """Blocks of 256 over the flat tensor (the last may be partial), each divided by its absolute
    maximum and rounded to the nearest code of the dynamic map, then multiplied back."""
    book = dynamic_map(signed)
    flat = values.reshape(-1)
    out = torch.empty_like(flat)
    for start in range(0, flat.numel(), 256):
        block = flat[start : start + 256]
        scale = block.abs().max().clamp(min=SMALLEST_SCALE)
        codes = (block.unsqueeze(1) / scale - book.unsqueeze(0)).abs().argmin(dim=1)
        out[start : start + 256] = book[codes] * scale
    return out.view_as(values)


def _kept(values: torch.Tensor, precision: str, signed: bool) -> torch.Tensor:
    if precision == "bf16":
        return values.bfloat16().float()
    if precision == "8bit":
        return _kept_8bit(values, signed)
    return values


def _compress_moments(reference: torch.optim.Optimizer, precision: str) -> None:
    for state in reference.state.values():
        state["exp_avg"].copy_(_kept(state["exp_avg"], precision, True))
        state["exp_avg_sq"].copy_(_kept(state["exp_avg_sq"], precision, False))


# -- models and steps ------------------------------------------------------------------------------


def _models(dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(96, 150), torch.nn.Tanh(), torch.nn.Linear(150, 7)).to(dtype)
    paged = torch.nn.Sequential(torch.nn.Linear(96, 150), torch.nn.Tanh(), torch.nn.Linear(150, 7)).to(dtype)
    paged.load_state_dict(reference.state_dict())
    return reference, paged


def _backward(model: torch.nn.Module, seed: int) -> None:
    dtype = next(model.parameters()).dtype
    x = torch.randn(16, 96, generator=torch.Generator().manual_seed(seed)).to(dtype)
    model(x).float().square().mean().backward()


def _reference_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, seeds: range, precision: str, clip: float | None) -> None:
    for seed in seeds:
        _backward(model, seed)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        _compress_moments(opt, precision)


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, seeds: range) -> None:
    for seed in seeds:
        _backward(model, seed)
        opt.step()
        opt.zero_grad()


def _assert_weights_close(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(x, y, msg=name)


# -- the update ------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
@pytest.mark.parametrize("where", ["host", "chunks", "disk"])
def test_compressed_update_equals_the_reference(tmp_path: Path, device_mode: str, precision: str, where: str) -> None:
    reference, paged = _models()
    clip = 0.05 if where != "host" else None
    expected = torch.optim.AdamW(reference.parameters(), lr=3e-3, fused=True)
    options: dict = {"min_offload_numel": 100, "max_grad_norm": clip}
    if where == "chunks":
        options["chunk_bytes"] = "16KiB"  # the first weight (14,400 elements) in chunks of whole blocks
    if where == "disk":
        options.update(offload="disk", disk_root=tmp_path / "s", host_capacity="160KiB", chunk_bytes="16KiB")
    opt = TieredAdamW(paged.parameters(), lr=3e-3, state_precision=precision, **options)
    try:
        if where != "host":
            assert opt._slots[0].chunks is not None and len(opt._slots[0].chunks) > 1
        _reference_steps(reference, expected, range(4), precision, clip)
        _steps(paged, opt, range(4))
        _assert_weights_close(reference, paged)
        saved = opt.state_dict()["state"]
        for index, param in enumerate(reference.parameters()):
            for name in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(saved[index][name], expected.state[param][name], msg=f"{index} {name}")
        if where == "disk":
            stats = opt.store.stats()
            assert stats["tiers"]["disk"]["used"] > 0  # state was paged out
    finally:
        opt.close()


def test_compressed_moments_differ_from_exact_ones_as_the_codec_says(device_mode: str) -> None:
    # The test above could pass with fp32 moments if the codec did nothing: check it did.
    _, paged = _models()
    exact = torch.optim.AdamW(paged.parameters(), lr=3e-3, fused=True)
    _, compressed_model = _models()
    opt = TieredAdamW(compressed_model.parameters(), lr=3e-3, state_precision="8bit", min_offload_numel=100)
    try:
        _steps(paged, exact, range(2))
        _steps(compressed_model, opt, range(2))
        ours = opt.state[next(compressed_model.parameters())]["exp_avg"]
        theirs = exact.state[next(paged.parameters())]["exp_avg"]
        assert not torch.equal(ours, theirs)
        assert torch.unique(ours.reshape(-1)[:256]).numel() < 256  # one block: values of one scale and the code book
    finally:
        opt.close()


@pytest.mark.parametrize(
    "precision, master, dtype, per_param",
    [("fp32", "fp32", torch.float32, 12.0), ("bf16", "fp32", torch.float32, 8.0), ("8bit", "fp32", torch.float32, 6 + 8 / 256),
     ("8bit", "lossless", torch.bfloat16, 4 + 8 / 256), ("bf16", "lossless", torch.bfloat16, 6.0)],
)
def test_bytes_stored_per_parameter(device_mode: str, precision: str, master: str, dtype: torch.dtype, per_param: float) -> None:
    model = torch.nn.Linear(256, 64, bias=False).to(dtype)  # 16,384 elements: 64 blocks
    opt = TieredAdamW(model.parameters(), state_precision=precision, master_weights=master, chunk_bytes=None)
    try:
        _steps_linear(model, opt)
        keys = [k for k in opt.namespace.keys() if not k.endswith("/grad")]
        assert len(keys) == 1
        if (master, dtype, device_mode) == ("fp32", torch.float32, "plain"):
            per_param -= 4.0  # on the plain CPU the fp32 parameter is the master: no master stored
        assert opt.store.info(keys[0])["nbytes"] == per_param * model.weight.numel()
        assert opt.memory_report().state_by_tier["host"] == per_param * model.weight.numel()
    finally:
        opt.close()


def _steps_linear(model: torch.nn.Linear, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, model.in_features, dtype=model.weight.dtype)).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_amsgrad_with_compressed_moments(device_mode: str) -> None:
    reference, paged = _models()
    expected = torch.optim.AdamW(reference.parameters(), lr=3e-3, fused=True, amsgrad=True)
    opt = TieredAdamW(paged.parameters(), lr=3e-3, amsgrad=True, state_precision="bf16", min_offload_numel=100)
    try:
        for seed in range(3):
            _reference_steps(reference, expected, range(seed, seed + 1), "bf16", None)
            for state in expected.state.values():
                state["max_exp_avg_sq"].copy_(state["max_exp_avg_sq"].bfloat16().float())
            _steps(paged, opt, range(seed, seed + 1))
        _assert_weights_close(reference, paged)
    finally:
        opt.close()


def test_bad_values_are_refused() -> None:
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="state_precision"):
        TieredAdamW(model.parameters(), state_precision="int4")
    with pytest.raises(ValueError, match="master_weights"):
        TieredAdamW(model.parameters(), master_weights="fp16")
    with pytest.raises(ValueError, match="bf16 parameters"):
        TieredAdamW(model.parameters(), master_weights="lossless")  # fp32 parameters
    with pytest.raises(ValueError, match="state_precision"):
        TieredAdamW([{"params": model.parameters(), "state_precision": "fp8"}])


# -- checkpoints -----------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
def test_state_dict_loads_into_torch_adamw_as_the_dequantised_moments(device_mode: str, precision: str) -> None:
    _, paged = _models()
    opt = TieredAdamW(paged.parameters(), lr=3e-3, state_precision=precision, min_offload_numel=100)
    try:
        _steps(paged, opt, range(3))
        saved = opt.state_dict()
        # torch's keys only: DCP's strict loading refuses keys one side lacks
        assert all(set(group) == set(torch_keys) for group in saved["param_groups"]
                   for torch_keys in [torch.optim.AdamW(paged.parameters()).state_dict()["param_groups"][0]])
        torch_opt = torch.optim.AdamW(paged.parameters(), lr=3e-3)
        torch_opt.load_state_dict(saved)
        for param in paged.parameters():
            for name in ("exp_avg", "exp_avg_sq"):
                assert torch_opt.state[param][name].dtype == torch.float32
                assert torch.equal(torch_opt.state[param][name], opt.state[param][name])
                # what the stored form keeps: re-encoding it changes nothing
                assert torch.equal(_kept(opt.state[param][name], precision, name == "exp_avg"), opt.state[param][name])
        _steps(paged, torch_opt, range(3, 4))  # and torch continues from it
    finally:
        opt.close()


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
def test_compressed_round_trip_through_state_dict_continues_equal(tmp_path: Path, device_mode: str, precision: str) -> None:
    first, second = _models()
    options = {"offload": "disk", "host_capacity": "128KiB", "chunk_bytes": "16KiB", "min_offload_numel": 100}
    a = TieredAdamW(first.parameters(), lr=3e-3, state_precision=precision, disk_root=tmp_path / "a", **options)
    b = None
    try:
        _steps(first, a, range(3))
        saved = a.state_dict()
        second.load_state_dict(first.state_dict())
        b = TieredAdamW(second.parameters(), lr=3e-3, state_precision=precision, disk_root=tmp_path / "b", **options)
        b.load_state_dict(saved)
        _steps(first, a, range(3, 6))
        _steps(second, b, range(3, 6))
        for x, y in zip(first.parameters(), second.parameters(), strict=True):
            assert torch.equal(x, y)
    finally:
        a.close()
        if b is not None:
            b.close()


def test_fp32_checkpoint_loads_compressed(device_mode: str) -> None:
    reference, paged = _models()
    exact = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    _steps(reference, exact, range(2))
    paged.load_state_dict(reference.state_dict())
    opt = TieredAdamW(paged.parameters(), lr=3e-3, state_precision="8bit", min_offload_numel=100)
    try:
        opt.load_state_dict(exact.state_dict())
        assert opt.param_groups[0]["state_precision"] == "8bit"  # the loading optimizer's choice stays
        param = next(paged.parameters())
        want = _kept(exact.state[next(reference.parameters())]["exp_avg"], "8bit", True)
        torch.testing.assert_close(opt.state[param]["exp_avg"], want)
        key = next(k for k in opt.namespace.keys() if not k.endswith("/grad"))
        assert opt.store.info(key)["dtype"] == torch.uint8
    finally:
        opt.close()


@pytest.mark.parametrize("master", ["fp32", "lossless"])
def test_restart_through_a_named_namespace(tmp_path: Path, device_mode: str, master: str) -> None:
    dtype = torch.bfloat16 if master == "lossless" else torch.float32
    reference, paged = _models(dtype)
    straight = TieredAdamW(reference.parameters(), lr=3e-3, state_precision="8bit", master_weights=master, min_offload_numel=100, chunk_bytes="16KiB")

    def run_with(seeds: range) -> None:
        store = SyncTierStore([HostTier("128KiB"), DiskTier(tmp_path / "store", "16MiB")]).open()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing of the saved state may be dropped
            opt = TieredAdamW(paged.parameters(), lr=3e-3, store=store, namespace="run", state_precision="8bit",
                              master_weights=master, min_offload_numel=100, chunk_bytes="16KiB")
        try:
            _steps(paged, opt, seeds)
        finally:
            opt.close()
            store.close()

    try:
        run_with(range(2))
        run_with(range(2, 4))
        _steps(reference, straight, range(4))
        for x, y in zip(reference.parameters(), paged.parameters(), strict=True):
            assert torch.equal(x, y)
    finally:
        straight.close()


def test_a_restart_with_another_precision_says_why_its_state_starts_over(tmp_path: Path, device_mode: str) -> None:
    """(the warning said the saved state "has another shape": the shapes were the same)"""
    _, paged = _models(torch.float32)
    store = SyncTierStore([HostTier("128KiB"), DiskTier(tmp_path / "store", "16MiB")]).open()
    opt = TieredAdamW(paged.parameters(), lr=3e-3, store=store, namespace="run", min_offload_numel=100)
    _steps(paged, opt, range(2))
    opt.close()
    with pytest.warns(UserWarning, match=r"is laid out for other settings \(another state_precision.*their saved state is deleted.*take the state_dict\(\) of the optimizer with the old ones \(before its close\(\)\)"):
        opt = TieredAdamW(paged.parameters(), lr=3e-3, store=store, namespace="run", state_precision="8bit", min_offload_numel=100)
    opt.close()
    store.close()


# -- the lossless master ---------------------------------------------------------------------------


# 8-bit moments are left out: a bf16 model's gradients have few significant bits, so moments
# fall on the midpoints between codes, where the test's argmin and the codec's search may pick
# either neighbour; the master's bits do not depend on how the moments are kept.
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("chunked", [False, True])
def test_lossless_master_is_the_fp32_master_bit_for_bit(device_mode: str, precision: str, chunked: bool) -> None:
    reference, paged = _models(torch.bfloat16)
    masters = [p.detach().float().clone() for p in reference.parameters()]  # the plain loop's fp32 masters
    expected = torch.optim.AdamW(masters, lr=3e-3, fused=True)
    opt = TieredAdamW(paged.parameters(), lr=3e-3, state_precision=precision, master_weights="lossless",
                      min_offload_numel=100, chunk_bytes="8KiB" if chunked else None)
    try:
        for seed in range(5):
            _backward(reference, seed)
            for master, param in zip(masters, reference.parameters(), strict=True):
                master.grad = param.grad.float()
            expected.step()
            _compress_moments(expected, precision)
            with torch.no_grad():
                for master, param in zip(masters, reference.parameters(), strict=True):
                    param.copy_((master.view(torch.int32) & -65536).view(torch.float32))  # truncation: exact
            reference.zero_grad()
            _steps(paged, opt, range(seed, seed + 1))
        saved = opt.state_dict()["state"]
        for index, (master, param) in enumerate(zip(masters, paged.parameters(), strict=True)):
            assert torch.equal(saved[index]["master"], master), index
            assert torch.equal(param, (master.view(torch.int32) & -65536).view(torch.float32).bfloat16())
        for x, y in zip(reference.parameters(), paged.parameters(), strict=True):
            assert torch.equal(x, y)
    finally:
        opt.close()


# -- the compiled 8-bit codec ----------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("signed", [True, False])
def test_compiled_codec_gives_the_eager_codecs_bits(signed: bool) -> None:
    from tierstore.optim.precision import BLOCK, dequantize, quantize

    torch.manual_seed(0)
    n = 5 * BLOCK + 37  # whole blocks (the kernel) and a partial one
    values = torch.randn(n) * 1e-3 if signed else torch.rand(n) ** 4 * 1e-6
    values[:BLOCK] = 0  # an all-zero block
    values[BLOCK : 2 * BLOCK] = values[BLOCK : 2 * BLOCK].sign() * 0.5  # ties on the absmax
    results = []
    for compiled in (False, True):
        codes, scales = torch.empty(n, dtype=torch.uint8), torch.empty(6)
        quantize(values, signed, codes, scales, compiled=compiled)
        results.append((codes, scales, dequantize(codes, scales, signed, torch.empty(n), compiled=compiled)))
    for eager, fast in zip(*results, strict=True):
        assert torch.equal(eager, fast)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("signed", [True, False])
def test_compiled_codec_gives_the_eager_codecs_bits_for_every_bucket(signed: bool) -> None:
    # Every fp32 high half a normalised value can have (|x| <= 1, both signs where signed), each
    # with random low bits and on both sides of its bucket: the compiled kernel's two lookups by
    # the high half give the eager search's codes.
    from tierstore.optim.precision import BLOCK, dequantize, quantize

    generator = torch.Generator().manual_seed(1)
    highs = torch.arange(0, 0x3F81, dtype=torch.int32)
    if signed:
        highs = torch.cat([highs, highs | 0x8000])
    words = (highs.repeat(3) << 16) | torch.cat([torch.zeros_like(highs), torch.full_like(highs, 0xFFFF),
                                                 torch.randint(0, 0xFFFF, highs.shape, generator=generator, dtype=torch.int32)])
    values = words.view(torch.float32).clamp(-1.0, 1.0)
    values = torch.cat([values, torch.zeros(-values.numel() % (BLOCK - 1))]).view(-1, BLOCK - 1)
    values = torch.cat([torch.ones(values.shape[0], 1), values], dim=1).reshape(-1)  # every block's absmax is 1
    n = values.numel()
    results = []
    for compiled in (False, True):
        codes, scales = torch.empty(n, dtype=torch.uint8), torch.empty(n // BLOCK)
        quantize(values, signed, codes, scales, compiled=compiled)
        results.append((codes, scales, dequantize(codes, scales, signed, torch.empty(n), compiled=compiled)))
    for eager, fast in zip(*results, strict=True):
        assert torch.equal(eager, fast)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compiled_codec_traces_once_for_tiles_of_any_size_and_place(monkeypatch: pytest.MonkeyPatch) -> None:
    # A tile's sizes and its views' offsets into the entry differ from tile to tile and entry to
    # entry: a guard on any of them would recompile per tile (and, past dynamo's cache limit,
    # run the kernels eager without a word).
    from torch._dynamo.utils import counters

    from tierstore.optim import precision as codec

    monkeypatch.setenv("TIERSTORE_COMPILE_CODEC", "1")
    monkeypatch.setattr(codec, "COMPILE_MIN_NUMEL", 1)
    monkeypatch.setattr(codec, "COMPILED_TILE", 4096)
    layout = codec.StateLayout("8bit", False, False)

    def updates(sizes: list[int]) -> None:
        for numel in sizes:
            state = codec.PackedState(layout, layout.empty(numel), numel)
            state.view("master").normal_()
            state.update(torch.randn(numel) * 1e-3, torch.tensor(0.0), _adam_rows)

    updates([4096, 3 * 4096 + 512, 4096 + 256])  # traced here: full and partial tiles, and a one-block tile (its own graph)
    if codec._COMPILED.failed:
        pytest.skip("no compiler for the compiled codec here")
    graphs = counters["stats"]["unique_graphs"]
    updates([2048, 5 * 4096 + 768, 2 * 4096 + 256, 7 * 1024, 9 * 4096 + 3 * 256])
    assert counters["stats"]["unique_graphs"] == graphs


# -- the tiled update ------------------------------------------------------------------------------


def _adam_rows(rows: list[torch.Tensor], grad: torch.Tensor, step: torch.Tensor) -> None:
    from torch.optim.adamw import adamw

    adamw([rows[0]], [grad.float()], [rows[1]], [rows[2]], [], [step], foreach=False, fused=True, amsgrad=False,
          beta1=0.9, beta2=0.999, lr=1e-2, weight_decay=0.1, eps=1e-8, maximize=False)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("precision, master", [("bf16", "fp32"), ("8bit", "fp32"), ("8bit", "lossless"), ("fp32", "lossless")])
def test_tiled_update_gives_the_bits_of_a_whole_entry_update(monkeypatch: pytest.MonkeyPatch, precision: str, master: str) -> None:
    # PackedState.update decodes, updates and encodes tile by tile (the compiled 8-bit codec on
    # whole-block tiles): the same bits as decoding the whole entry into fp32, one AdamW call,
    # and encoding it back with the eager codec.
    from tierstore.optim import precision as codec

    monkeypatch.setattr(codec, "UPDATE_TILE", 1024)
    monkeypatch.setattr(codec, "COMPILED_TILE", 1024)
    monkeypatch.setattr(codec, "COMPILE_MIN_NUMEL", 1)
    numel = 2 * 1024 + 300  # two whole tiles and one ending in a partial block
    layout = codec.StateLayout(precision, master == "lossless", False)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(numel, generator=generator).bfloat16() if master == "lossless" else None
    start = codec.PackedState(layout, layout.empty(numel), numel, weight)
    rows = torch.randn(3, numel, generator=generator) * torch.tensor([[1.0], [1e-3], [1e-6]])
    rows[2].abs_()
    if weight is not None:
        rows[0] = weight.float()
    start.encode(rows)
    for compiled in ("0", "1"):
        monkeypatch.setenv("TIERSTORE_COMPILE_CODEC", compiled)
        whole = codec.PackedState(layout, start.buffer.clone(), numel, weight)
        tiled = codec.PackedState(layout, start.buffer.clone(), numel, weight)
        for seed in range(3):
            grad = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 1e-3
            if weight is not None:
                grad = grad.bfloat16()
            counts = [torch.tensor(float(seed)), torch.tensor(float(seed))]
            master_rows = [whole.master(), *(whole.moment(name) for name in layout.moments)]
            _adam_rows(master_rows, grad, counts[0])
            whole.set_master(master_rows[0])
            for name, value in zip(layout.moments, master_rows[1:], strict=True):
                codes = value.reshape(-1)
                if precision == "8bit":
                    codec.quantize(codes, name == "exp_avg", whole.view(f"{name}/codes"), whole.view(f"{name}/scale"), compiled=False)
                else:
                    whole.set_moment(name, codes)
            tiled.update(grad, counts[1], _adam_rows)
            assert torch.equal(counts[0], counts[1])
            assert torch.equal(whole.buffer, tiled.buffer), (compiled, seed)
            if weight is not None:
                assert torch.equal(whole.weight().view(torch.int16), tiled.weight().view(torch.int16))
        assert not torch.equal(tiled.buffer, start.buffer)  # it did update


def test_tiled_update_refuses_a_gradient_of_another_size() -> None:
    from tierstore.optim import precision as codec

    layout = codec.StateLayout("bf16", False, False)
    state = codec.PackedState(layout, layout.empty(512), 512)
    with pytest.raises(ValueError, match="gradient of 511 elements"):
        state.update(torch.zeros(511), torch.tensor(0.0), _adam_rows)


@pytest.mark.parametrize("precision", ["fp32", "8bit"])
def test_a_master_that_torch_kept_but_never_updated_restarts_from_the_weight(precision: str) -> None:
    """torch's AdamW keeps our 'master' entry (cast to bf16) without updating it: loaded back, it
    was written into the parameter at the next step, undoing every step torch took."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(64, 64).bfloat16())
    ours = TieredAdamW([weight], lr=1e-2, state_precision=precision, offload="host")
    for _ in range(3):
        weight.grad = torch.randn(64, 64).bfloat16()
        ours.step()
    saved = ours.state_dict()
    ours.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch casts what it loads)
        theirs = torch.optim.AdamW([weight], lr=1e-1)
        theirs.load_state_dict(saved)
    for _ in range(5):
        weight.grad = torch.randn(64, 64).bfloat16()
        theirs.step()
    trained = weight.detach().clone()
    again = TieredAdamW([weight], lr=1e-2, state_precision=precision, offload="host")
    again.load_state_dict(theirs.state_dict())
    weight.grad = torch.zeros(64, 64, dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="master weight loaded from the checkpoint does not round to the parameter's value"):
        again.step()  # (a zero gradient: the weight moves by what the moments carry, not back to step 3)
    assert (weight.detach().float() - trained.float()).abs().max() < 0.1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # our own round trip: the master is the weight's, no warning
        again.load_state_dict(again.state_dict())
        again.step()
    again.close()


@pytest.mark.parametrize("precision", ["fp32", "8bit"])
@pytest.mark.parametrize("master_weights", ["fp32", "lossless"])
@pytest.mark.parametrize("optimizer_first", [False, True])
def test_a_bf16_resume_keeps_the_fp32_master_whichever_is_loaded_first(optimizer_first: bool, master_weights: str, precision: str) -> None:
    """Loaded before the model's weights, the master was replaced by the fresh weights (its
    extra bits lost, the continued run off by bf16 roundings); it is checked at the first update
    now, when the model's weights are the checkpoint's."""

    def make() -> torch.nn.Linear:
        return torch.nn.Linear(64, 64).bfloat16()

    def train(model: torch.nn.Linear, opt: TieredAdamW, steps: range) -> None:
        for step in steps:
            opt.zero_grad()
            model(torch.randn(8, 64, generator=torch.Generator().manual_seed(step)).bfloat16()).float().square().mean().backward()
            opt.step()

    torch.manual_seed(0)
    straight = make()
    opt = TieredAdamW(straight.parameters(), lr=1e-2, offload="host", master_weights=master_weights, state_precision=precision)
    train(straight, opt, range(3))
    model_state, opt_state = {k: v.clone() for k, v in straight.state_dict().items()}, opt.state_dict()
    train(straight, opt, range(3, 6))
    opt.close()
    torch.manual_seed(1)
    resumed = make()
    again = TieredAdamW(resumed.parameters(), lr=1e-2, offload="host", master_weights=master_weights, state_precision=precision)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no master is lost, so nothing to warn of)
        if optimizer_first:
            again.load_state_dict(opt_state)
            again.state_dict()  # (a read in between checked the master against the fresh weight, and replaced it)
            resumed.load_state_dict(model_state)
        else:
            resumed.load_state_dict(model_state)
            again.load_state_dict(opt_state)
        train(resumed, again, range(3, 6))
    again.close()
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), straight.parameters(), strict=True))


@pytest.mark.parametrize(("key", "before", "after"), [("state_precision", "fp32", "8bit"), ("state_precision", "8bit", "fp32"),
                                                      ("state_precision", "bf16", "int4"), ("amsgrad", False, True)])
@pytest.mark.parametrize("in_backward", [False, True])
def test_a_layout_setting_changed_in_param_groups_is_refused(key: str, before: object, after: object, in_backward: bool) -> None:
    """``opt.param_groups[0]["state_precision"] = "8bit"`` after a step: the next step read the
    fp32 state as 8-bit (the moments restarted from zero while the step count went on; 8bit to
    fp32: ``state_dict()`` an ``AttributeError``, a paged state ``TierFullError``; "int4" a
    ``KeyError``). Each is a ``ValueError`` now, at ``step()`` (in backward, at the first
    gradient), ``state_dict()`` and ``opt.state``, nothing changed; set back, training goes on
    as torch's AdamW."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    settings = {"state_precision": before} if key == "state_precision" else {"amsgrad": before}
    opt = TieredAdamW(model.parameters(), lr=1e-2, step_in_backward=in_backward, **settings)  # type: ignore[arg-type]
    reference = TieredAdamW([torch.nn.Parameter(p.detach().clone()) for p in model.parameters()], lr=1e-2, **settings)  # type: ignore[arg-type]

    def step(o: TieredAdamW, params: list[torch.Tensor]) -> None:
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
        o.zero_grad()
        torch.nn.functional.linear(x, params[0], params[1]).square().mean().backward()
        o.step()

    for _ in range(2):
        step(opt, list(model.parameters()))
        step(reference, reference.param_groups[0]["params"])
    opt.param_groups[0][key] = after
    with pytest.raises(ValueError, match=f"param group 0's {key} from {before!r} to {after!r} was changed"):
        step(opt, list(model.parameters()))
    for read in (opt.state_dict, lambda: opt.state[model.weight]):
        with pytest.raises(ValueError, match="was changed in param_groups"):
            read()
    opt.param_groups[0][key] = before
    step(opt, list(model.parameters()))
    step(reference, reference.param_groups[0]["params"])
    for mine, theirs in zip(model.parameters(), reference.param_groups[0]["params"], strict=True):
        assert torch.equal(mine, theirs)
    opt.close()
    reference.close()


def test_a_layout_setting_changed_before_the_first_step_is_taken() -> None:
    """As with torch, a group's settings may change before it has state (the review found the
    first version refusing it); a group dict replaced after, with another layout, is refused."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    mine = TieredAdamW(model.parameters(), lr=1e-2)
    reference = torch.optim.AdamW([p.detach().clone().requires_grad_() for p in model.parameters()], lr=1e-2, amsgrad=True, fused=True)
    mine.param_groups[0]["amsgrad"] = True
    for _ in range(2):
        for o, (w, b) in ((mine, model.parameters()), (reference, reference.param_groups[0]["params"])):
            o.zero_grad()
            torch.nn.functional.linear(torch.ones(4, 64), w, b).square().mean().backward()
            o.step()
    assert all(torch.equal(x, y) for x, y in zip(model.parameters(), reference.param_groups[0]["params"], strict=True))
    mine.param_groups[0] = {**mine.param_groups[0], "amsgrad": False}
    with pytest.raises(ValueError, match="amsgrad from True to False was changed"):
        mine.state_dict()
    mine.close()
    # (a setting changed before any state is still checked as the constructor checks it: an
    # unknown precision failed part-way through the step, "lossless" on fp32 weights too)
    for key, value, says in (("state_precision", "fp13", "state_precision must be one of"),
                             ("master_weights", "lossless", "needs bf16 parameters")):
        fresh = TieredAdamW(torch.nn.Linear(4, 4).parameters())
        fresh.param_groups[0][key] = value
        with pytest.raises(ValueError, match=says):
            fresh.step()
        fresh.close()
