"""DCP checkpoints of paged state through a bounded buffer (``tierstore.optim.dcp``): the same
checkpoint as ``get_optimizer_state_dict`` + ``dcp.save``; save -> load -> continue equal to the
uninterrupted run bit for bit (streaming and standard loads, TieredAdamW <-> torch's AdamW, DDP,
sharded state, FSDP2, resharded 2 -> 1 and, on the plain CPU, 2 -> 3); and the memory a streaming save and load of
state mostly on disk takes, against the state's size. Ranks run ``run_rank`` in processes the
tests spawn (gloo), each job with a time limit; both device modes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from spawned import gloo_group
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from tierstore.bench.distributed import PeakRSS
from tierstore.optim import TieredAdamW, load_optimizer, optimizer_state_dict, save_optimizer
from tierstore.optim.distributed import free_port

STEPS, MORE, LR = 3, 2, 1e-2
LIMIT_S = 120  # per spawned job (a 2-core machine)


def base_model() -> torch.nn.Module:
    torch.manual_seed(0)  # uneven sizes: 680, 984 and 125 elements
    return torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.Tanh(), torch.nn.Linear(40, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5))


def train(model: torch.nn.Module, opt: Any, steps: int, seed: int, rank: int = 0) -> None:
    data = torch.randn(steps, 4, 16, generator=torch.Generator().manual_seed(1000 * seed + rank))
    for x in data:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t.detach()  # type: ignore[no-any-return]


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [local(p).clone() for p in model.parameters()]


def with_weights(model: torch.nn.Module, saved: list[torch.Tensor]) -> torch.nn.Module:
    with torch.no_grad():
        for p, w in zip(model.parameters(), saved, strict=True):
            local(p).copy_(w)
    return model


def equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(local(x), local(y)) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def tiered(params: Any, root: Path, **options: Any) -> TieredAdamW:
    return TieredAdamW(params, lr=LR, fused=True, min_offload_numel=64, **options)


def adamw(params: Any) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, fused=True)


def standard_load(path: Path, model: torch.nn.Module, opt: Any) -> None:
    state = {"optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=str(path))
    set_optimizer_state_dict(model, opt, state["optim"])


def stream_load(path: Path, model: torch.nn.Module, opt: Any) -> None:
    load_optimizer(opt, path, model)


def metadata(path: Path) -> dict[str, Any]:
    return dict(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


# -- jobs of the spawned ranks -------------------------------------------------------------------


def fsdp(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def save_and_load(rank: int, world: int, out: Path) -> dict[str, Any]:
    result: dict[str, Any] = {}
    root = out / "disk"

    def ddp() -> torch.nn.Module:
        return DDP(base_model(), bucket_cap_mb=0.001)

    reference = ddp()
    ref_opt = adamw(reference.parameters())
    train(reference, ref_opt, STEPS, 1, rank)
    runs = {"ddp": ddp(), "zero1": ddp()}
    opts = {
        "ddp": tiered(runs["ddp"].parameters(), root),
        "zero1": tiered(runs["zero1"].parameters(), root, process_group=True, offload="disk", disk_root=root),
    }
    for name in runs:
        train(runs[name], opts[name], STEPS, 1, rank)
    fsdp_ref, fsdp_ours = fsdp(base_model()), fsdp(base_model())
    fsdp_ref_opt, fsdp_opt = adamw(fsdp_ref.parameters()), tiered(fsdp_ours.parameters(), root, offload="disk", disk_root=root / "fsdp")
    train(fsdp_ref, fsdp_ref_opt, STEPS, 1, rank)
    train(fsdp_ours, fsdp_opt, STEPS, 1, rank)
    saved = {"ddp": weights(reference), "fsdp": weights(fsdp_ref)}

    save_optimizer(opts["ddp"], out / "ddp", runs["ddp"])
    save_optimizer(opts["zero1"], out / "zero1", runs["zero1"])
    save_optimizer(fsdp_opt, out / "fsdp", fsdp_ours)
    dcp.save({"optim": get_optimizer_state_dict(runs["zero1"], opts["zero1"])}, checkpoint_id=str(out / "zero1_standard"))
    dcp.save({"optim": get_optimizer_state_dict(fsdp_ours, fsdp_opt)}, checkpoint_id=str(out / "fsdp_standard"))
    dcp.save({"optim": get_optimizer_state_dict(reference, ref_opt)}, checkpoint_id=str(out / "torch"))
    dist.barrier()
    # the same checkpoint as the standard path: keys, shapes, chunks, dtypes
    result["zero1_layout_equal"] = metadata(out / "zero1") == metadata(out / "zero1_standard")
    result["fsdp_layout_equal"] = metadata(out / "fsdp") == metadata(out / "fsdp_standard")

    train(reference, ref_opt, MORE, 2, rank)  # the uninterrupted runs
    train(fsdp_ref, fsdp_ref_opt, MORE, 2, rank)
    loads: dict[str, tuple[str, Any, Any]] = {
        # name: (checkpoint, optimizer to load into (model, disk folder), how)
        "zero1_stream_to_zero1_stream": ("zero1", lambda m, d: tiered(m.parameters(), root, process_group=True, offload="disk", disk_root=d), stream_load),
        "zero1_stream_to_ddp_stream": ("zero1", lambda m, d: tiered(m.parameters(), root, offload="disk", disk_root=d), stream_load),
        "zero1_stream_to_torch": ("zero1", lambda m, d: adamw(m.parameters()), standard_load),
        "ddp_stream_to_zero1_standard": ("ddp", lambda m, d: tiered(m.parameters(), root, process_group=True), standard_load),
        "torch_to_zero1_stream": ("torch", lambda m, d: tiered(m.parameters(), root, process_group=True, offload="disk", disk_root=d), stream_load),
    }
    for name, (source, make, how) in loads.items():
        model = with_weights(ddp(), saved["ddp"])
        opt = make(model, root / name)
        how(out / source, model, opt)
        train(model, opt, MORE, 2, rank)
        result[name] = equal(model, reference)
        if isinstance(opt, TieredAdamW):
            opt.close()
    for name, make, how in (
        ("fsdp_stream_to_fsdp_stream", lambda m: tiered(m.parameters(), root, offload="disk", disk_root=root / "fsdp2"), stream_load),
        ("fsdp_stream_to_torch", lambda m: adamw(m.parameters()), standard_load),
    ):
        model = with_weights(fsdp(base_model()), saved["fsdp"])
        opt = make(model)
        how(out / "fsdp", model, opt)
        train(model, opt, MORE, 2, rank)
        result[name] = equal(model, fsdp_ref)
        if isinstance(opt, TieredAdamW):
            opt.close()
    for opt in (*opts.values(), fsdp_opt):
        opt.close()
    torch.save(saved["ddp"], out / f"weights{rank}.pt")  # the weights at saving, for the resharded runs
    return result


def same_part(ours: torch.Tensor, whole: torch.Tensor) -> bool:
    """Whether ``ours`` (a tensor, or a DTensor holding this rank's part) equals its part of ``whole``."""
    if not hasattr(ours, "_local_tensor"):
        return torch.equal(ours, whole)
    chunk = ours.__create_chunk_list__()[0]  # type: ignore[attr-defined]  # where this rank's part sits (DCP's view)
    part = whole[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes, strict=True))]
    return torch.equal(local(ours), part)


def reshard(rank: int, world: int, out: Path, make: Any = None) -> dict[str, Any]:
    """The 2-rank checkpoints into ``world`` ranks: ours (streaming, sharded by ``world``, a
    small buffer: several passes, as many on every rank) against torch's AdamW from its own."""
    root = out / "disk"
    make = make or (lambda: DDP(base_model(), bucket_cap_mb=0.001))
    saved = torch.load(out / "weights0.pt", weights_only=True)  # the test's own file: DDP weights are equal on every rank
    ours = with_weights(make(), saved)
    sharded = {"process_group": True} if dist.is_initialized() else {}
    opt = tiered(ours.parameters(), root, offload="disk", disk_root=root / f"reshard{world}", **sharded)
    load_optimizer(opt, out / "zero1", ours, buffer_bytes=8 << 10)
    theirs = with_weights(make(), saved)
    ref = adamw(theirs.parameters())
    standard_load(out / "torch", theirs, ref)
    loaded_equal = all(
        same_part(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"]) and torch.equal(opt.state[p]["step"], ref.state[q]["step"])
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True)
        if opt.state[p]
    )
    train(ours, opt, MORE, 3, rank)
    train(theirs, ref, MORE, 3, rank)
    result = {"loaded_equal": loaded_equal, "continued_equal": equal(ours, theirs), "owned": [i for i, p in enumerate(ours.parameters()) if opt.state[p]]}
    opt.close()
    return result


def reshard_here(out: Path) -> dict[str, Any]:
    """``reshard`` into this one process, without a process group (DCP's single-process mode)."""
    return reshard(0, 1, out, lambda: base_model())


def run_rank(rank: int, world: int, port: int, mode: str, out: str, job: str) -> None:
    from tierstore.device import emulate_device

    with gloo_group(rank, world, port), emulate_device(mode == "emulated"):
        result = (save_and_load if job == "save" else reshard)(rank, world, Path(out))
        Path(out, f"{job}{world}-rank{rank}.json").write_text(json.dumps(result))


def _spawn(job: str, world: int, mode: str, out: Path) -> list[dict[str, Any]]:
    script = (
        "import sys, torch.multiprocessing as mp; sys.path.insert(0, sys.argv[1]); import test_dcp_stream as j; "
        "mp.spawn(j.run_rank, args=(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6]), nprocs=int(sys.argv[2]), join=True)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(Path(__file__).parent), str(world), str(free_port()), mode, str(out), job],
        capture_output=True, text=True, timeout=LIMIT_S,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"{job}{world}-rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.device_modes
def test_streaming_checkpoints_across_ranks(tmp_path: Path, device_mode: str) -> None:
    ranks = _spawn("save", 2, device_mode, tmp_path)
    for r in ranks:
        assert r["zero1_layout_equal"] and r["fsdp_layout_equal"], r
        assert all(r[name] for name in (
            "zero1_stream_to_zero1_stream", "zero1_stream_to_ddp_stream", "zero1_stream_to_torch", "ddp_stream_to_zero1_standard",
            "torch_to_zero1_stream", "fsdp_stream_to_fsdp_stream", "fsdp_stream_to_torch",
        )), r
    # resharded: into this process (no process group) and, on the plain CPU, into 3 ranks
    here = reshard_here(tmp_path)
    assert here["loaded_equal"] and here["continued_equal"] and here["owned"] == list(range(6)), here
    if device_mode == "plain":
        resharded = _spawn("reshard", 3, device_mode, tmp_path)
        assert all(r["loaded_equal"] and r["continued_equal"] for r in resharded), resharded
        # every parameter's state is somewhere (a parameter split by rows, on several ranks), every rank has some
        assert set().union(*(r["owned"] for r in resharded)) == set(range(6)) and all(r["owned"] for r in resharded)


# -- one process: the memory bound ----------------------------------------------------------------


def memory_job(out: Path, mode: str) -> dict[str, Any]:
    """48 MiB of state, a 4 MiB host tier (the rest on disk): the process's growth while saving
    and loading it streaming, and while saving it the standard way; and whether the loaded state
    continues as the saved one does."""
    from tierstore.device import emulate_device

    with emulate_device(mode == "emulated"):
        torch.manual_seed(0)
        width, depth = 512, 16
        model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(depth)))
        result: dict[str, Any] = {"state_bytes": 12 * sum(p.numel() for p in model.parameters())}
        opt = TieredAdamW(model.parameters(), lr=LR, fused=True, offload="disk", disk_root=out / "a", host_capacity=4 << 20)
        x = torch.randn(2, width, generator=torch.Generator().manual_seed(0))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        stored = opt.memory_report().state_by_tier
        result["disk_bytes"], result["stored_bytes"] = stored.get("disk", 0), sum(stored.values())
        with PeakRSS() as save_peak:
            save_optimizer(opt, out / "stream", model, buffer_bytes=2 << 20)
        with PeakRSS() as standard_peak:
            dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=str(out / "standard"))
        result["layout_equal"] = metadata(out / "stream") == metadata(out / "standard")
        copy = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(depth)))
        copy.load_state_dict(model.state_dict())
        loaded = TieredAdamW(copy.parameters(), lr=LR, fused=True, offload="disk", disk_root=out / "b", host_capacity=4 << 20)
        with PeakRSS() as load_peak:
            load_optimizer(loaded, out / "stream", copy, buffer_bytes=2 << 20)
        for net, o in ((model, opt), (copy, loaded)):
            o.zero_grad()
            net(x).pow(2).mean().backward()
            o.step()
        result.update(save=save_peak.growth, standard=standard_peak.growth, load=load_peak.growth, continued=equal(model, copy))
        opt.close()
        loaded.close()
    return result


def test_streaming_save_and_load_memory_is_bounded(tmp_path: Path) -> None:
    """Saving and loading state that is mostly on disk grows the process by well under the
    state's size: about the buffer (2 MiB), twice the largest parameter's state (3 MiB) and the
    host tier (4 MiB) here; the standard save holds all of it (so the measurement sees what it
    should). On the plain CPU and the emulated device, in one process of its own.

    That process runs with glibc's mmap threshold fixed at 128 KiB (as it is for tensors of 32
    MiB and more whatever the setting): by default glibc raises the threshold to the size of a
    freed block and then keeps freed blocks of a few MiB in its arenas, which the RSS would
    count (for this small model's tensors, not for a large one's)."""
    script = (
        "import sys, json; sys.path.insert(0, sys.argv[1]); import test_dcp_stream as j; from pathlib import Path; "
        "print(json.dumps([j.memory_job(Path(sys.argv[2], mode), mode) for mode in ('plain', 'emulated')]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(Path(__file__).parent), str(tmp_path)],
        capture_output=True, text=True, timeout=LIMIT_S, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    for r in json.loads(done.stdout.strip().splitlines()[-1]):
        state = r["state_bytes"]
        assert r["disk_bytes"] > 0.8 * r["stored_bytes"] and r["layout_equal"] and r["continued"], r
        assert r["standard"] > 0.5 * state, r
        assert r["save"] < state / 4 and r["load"] < state / 3, r


def test_bad_input(tmp_path: Path) -> None:
    model = base_model()
    with pytest.raises(TypeError, match="TieredAdam"):
        optimizer_state_dict(adamw(model.parameters()), model)  # type: ignore[arg-type]
    opt = tiered(model.parameters(), tmp_path)
    with pytest.raises(ValueError, match="buffer_bytes"):
        load_optimizer(opt, tmp_path / "none", model, buffer_bytes=0)
    with pytest.raises(TypeError, match="planner"):
        save_optimizer(opt, tmp_path / "x", model, planner=None)
    opt.close()


def test_the_optimizers_state_dict_hooks_run_on_a_streamed_checkpoint(tmp_path: Path) -> None:
    """A reviewer: the streaming path ran none of the hooks registered on the optimizer
    (``register_state_dict_pre_hook``/``_post_hook``, ``register_load_state_dict_post_hook``),
    which torch's ``state_dict``/``load_state_dict`` run, so an entry a post-hook adds was
    missing from the checkpoint and a load post-hook never ran. A load pre-hook, which takes
    the whole dict, cannot run on a streamed load: refused before anything is loaded."""
    model = base_model()
    opt = tiered(model.parameters(), tmp_path / "store")
    train(model, opt, STEPS, seed=0)
    calls: list[str] = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))

    def add_warmup(o: Any, state_dict: dict[str, Any]) -> None:
        calls.append("post")
        for group in state_dict["param_groups"]:
            group["warmup"] = 7

    opt.register_state_dict_post_hook(add_warmup)
    loaded: list[int] = []
    opt.register_load_state_dict_post_hook(lambda o: loaded.append(o.param_groups[0]["warmup"]))
    save_optimizer(opt, tmp_path / "ckpt", model)
    assert calls == ["pre", "post"]
    twin = base_model()
    reference = adamw(twin.parameters())
    train(twin, reference, 1, seed=0)
    reference.register_state_dict_post_hook(lambda o, sd: [group.update(warmup=0) for group in sd["param_groups"]] and None)
    standard_load(tmp_path / "ckpt", twin, reference)  # torch's AdamW loads what our hook saved
    assert reference.param_groups[0]["warmup"] == 7
    load_optimizer(opt, tmp_path / "ckpt", model)
    assert loaded == [7]
    handle = opt.register_load_state_dict_pre_hook(lambda o, sd: sd)
    before = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="pre-hooks"):
        load_optimizer(opt, tmp_path / "ckpt", model)
    assert all(torch.equal(opt.state[p]["exp_avg"], b) for p, b in zip(model.parameters(), before, strict=True))
    handle.remove()
    opt.close()
