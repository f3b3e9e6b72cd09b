"""A checkpoint's fp32 master loaded into a lossless master (``master_weights="lossless"``).

A lossless master stores only the low 16 bits of the fp32 master: its high half is the model's
bf16 weight, which a lossless optimizer writes as the master truncated. A checkpoint saved with
a full fp32 master (``master_weights="fp32"``, or torch's AdamW loading ours) comes with
weights that are the master *rounded* to nearest: taken as the high half, about half of the
elements would be off by one bf16 step. The weights may be loaded before or after the
optimizer's state, so which weight the model holds is only known at the first update.

So a load keeps, beside the low halves, a digest of each of the two weights the master can have
(truncated and rounded), per range of elements the state is updated in (the whole parameter,
and each chunk), and the few elements rounding cannot tell apart: a low half of exactly 0x8000
rounds up only when the high half is odd. Whenever the state of a range is read (an update, or
``state_dict()`` before the first one) and until the optimizer writes the weight, the digest of
the weight the model holds there says which one it is, and a rounded one is turned back into
the master's high halves exactly; a weight that is neither (trained further, not the
checkpoint's) restarts the master from the weight at the update, with a warning, as an fp32
master does.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

#: A low half that rounds up only from an odd high half (round to nearest, ties to even).
_TIE = 0x8000


def _digest(weight: torch.Tensor) -> int:
    return zlib.crc32(weight.detach().reshape(-1).contiguous().view(torch.int16).numpy().tobytes())


@dataclass(frozen=True)
class LoadedMaster:
    """What a lossless optimizer keeps of a loaded fp32 master beyond its low halves (see the
    module docstring), for one parameter (the elements its optimizer updates): per range of
    elements its state is updated in (the whole, and each chunk), the digests of the truncated
    and of the rounded weight."""

    digests: dict[tuple[int, int], tuple[int, int]]
    #: Elements whose low half is exactly 0x8000 and whose rounded weight is one step up.
    ties_up: torch.Tensor

    @classmethod
    def of(cls, master: torch.Tensor, ranges: list[tuple[int, int]]) -> LoadedMaster:
        """Of fp32 ``master`` (flat), with digests for the element ranges ``ranges`` and the whole."""
        flat = master.detach().reshape(-1).float().contiguous()
        halves = flat.view(torch.int16).view(-1, 2)
        low = halves[:, 0].to(torch.int32) & 0xFFFF
        high = halves[:, 1]
        rounded = flat.bfloat16()
        ties_up = torch.nonzero((low == _TIE) & (high.to(torch.int32) & 1 == 1)).reshape(-1)
        spans = {(0, flat.numel()), *ranges}
        return cls({(a, b): (_digest(high[a:b]), _digest(rounded[a:b])) for a, b in spans}, ties_up)

    def which(self, weight: torch.Tensor, start: int) -> str | None:
        """Which weight ``weight`` (elements ``start:start + len(weight)``) is: "truncated" (a
        lossless optimizer's; also where no element of the range rounds up), "rounded" (an fp32
        master's) or "neither"; None for a range without digests (ask again with the whole)."""
        digests = self.digests.get((start, start + weight.numel()))
        if digests is None:
            return None
        digest = _digest(weight)
        return "truncated" if digest == digests[0] else "rounded" if digest == digests[1] else "neither"

    def high_of_rounded(self, weight: torch.Tensor, low: torch.Tensor, start: int) -> torch.Tensor:
        """The master's high halves of elements ``start:start + len(weight)`` from the rounded
        ``weight`` there and the stored ``low`` halves: one step down where rounding went up."""
        bits = weight.reshape(-1).view(torch.int16).to(torch.int32)
        unsigned_low = low.reshape(-1).to(torch.int32) & 0xFFFF
        up = unsigned_low > _TIE
        ties = self.ties_up[(self.ties_up >= start) & (self.ties_up < start + bits.numel())] - start
        up[ties] = True
        # (a magnitude one step up is the bit pattern plus one, for either sign)
        return (bits - up.to(torch.int32)).to(torch.int16).view(torch.bfloat16)
