"""Sharded state (``process_group=True``, gloo ranks) of a parameter split at an element that is
not a multiple of the vector width: torch's fused CPU Adam runs a tensor's full vectors in one
code path and its last few elements in a scalar one, which rounds differently; a rank that ran
the kernel on its own rows put elements of the whole tensor's vector body into its slice's
scalar tail (a 5003-element weight on 3 ranks: 1668 rows each) and the weights and moments
differed from DDP + ``torch.optim.AdamW(fused=True)`` in the last bit, at the cuts. Each rank
now runs the elements before its first and after its last whole vector of the tensor as torch
does in the whole tensor."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from spawned import gloo_group, spawn_ranks

LIMIT_S = 240
STEPS = 3
#: (name, the dominant parameter, the optimizer's options)
RUNS = (
    ("vector_host", "vector", {"offload": "host"}),
    ("vector_disk_chunked", "vector", {"offload": "disk", "chunk_bytes": 12 * 1024}),
    ("embedding_host", "embedding", {"offload": "host"}),
    ("embedding_disk_chunked", "embedding", {"offload": "disk", "chunk_bytes": 12 * 1024}),
)


class _Odd(torch.nn.Module):
    """A parameter dominating the state, cut by the ranks inside a vector: a 1-D weight of 20003
    elements (cut at 10002, or 6668 and 13336) or an embedding with rows of 13 elements; and a
    small weight beside it."""

    def __init__(self, dominant: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.big = torch.nn.Parameter(torch.randn(20003) * 0.01) if dominant == "vector" else None
        self.emb = torch.nn.Embedding(3001, 13) if dominant == "embedding" else None
        self.small = torch.nn.Parameter(torch.randn(10))

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        main = (self.big * x).pow(2).sum() if self.big is not None else self.emb(tokens).pow(2).mean()  # type: ignore[misc]
        return main + self.small.pow(2).sum()


def run_rank(rank: int, world: int, port: int, out: str) -> None:
    warnings.simplefilter("ignore")
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tierstore.optim import TieredAdamW, attach_ddp

    with gloo_group(rank, world, port, timeout_s=60):
        result: dict[str, Any] = {}
        for name, dominant, options in RUNS:
            base = _Odd(dominant)
            ref = DDP(copy.deepcopy(base))
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
            ours = DDP(copy.deepcopy(base))
            where = {"disk_root": str(Path(out, "disk"))} if options["offload"] == "disk" else {}
            opt = TieredAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1, process_group=True, **where, **options)
            attach_ddp(opt, ours)
            for step in range(STEPS):
                gen = torch.Generator().manual_seed(step * 10 + rank)
                x, tokens = torch.randn(20003, generator=gen), torch.randint(0, 3001, (4, 7), generator=gen)
                for model, optimizer in ((ref, ref_opt), (ours, opt)):
                    optimizer.zero_grad()
                    model(x, tokens).backward()
                    optimizer.step()
            theirs = ref.module.state_dict()
            result[f"{name}_weights_differing"] = {
                key: int((value != theirs[key]).sum()) for key, value in ours.module.state_dict().items()
            }
            saved = opt.state_dict()["state"]  # (rank-local; a split state is this rank's rows)
            moments = {}
            for index, (p, q) in enumerate(zip(ours.parameters(), ref.parameters(), strict=True)):
                mine = opt.state[p]
                if not mine:
                    continue
                for moment in ("exp_avg", "exp_avg_sq"):
                    value = mine[moment]
                    local = value.to_local() if hasattr(value, "to_local") else value
                    whole = ref_opt.state[q][moment]
                    if local.shape != whole.shape:  # this rank's rows of a split parameter
                        start = _row_start(value) * (whole.numel() // whole.shape[0])
                        whole = whole.reshape(-1)[start : start + local.numel()].view(local.shape)
                    moments[f"{index}.{moment}"] = int((local != whole).sum())
            result[f"{name}_moments_differing"] = moments
            result[f"{name}_split"] = bool(saved) and any(
                hasattr(opt.state[p].get("exp_avg"), "to_local") for p in ours.parameters() if opt.state[p]
            )
            opt.close()
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def _row_start(value: Any) -> int:
    """The first row of this rank's part of a DTensor sharded by rows (``torch.chunk``'s split)."""
    import torch.distributed as dist

    rows = value.shape[0]
    per = -(-rows // dist.get_world_size())
    return dist.get_rank() * per


@pytest.mark.parametrize("world", [2, 3])
def test_split_parameters_match_ddp_and_fused_adamw_bit_for_bit(tmp_path: Path, world: int) -> None:
    ranks = spawn_ranks(__file__, tmp_path, LIMIT_S, world=world)
    for rank in ranks:
        for name, _, _ in RUNS:
            assert rank[f"{name}_split"], "the test needs a parameter split across the ranks"
            assert all(n == 0 for n in rank[f"{name}_weights_differing"].values()), (name, rank[f"{name}_weights_differing"])
            assert rank[f"{name}_moments_differing"] and all(n == 0 for n in rank[f"{name}_moments_differing"].values()), (
                name, rank[f"{name}_moments_differing"])
