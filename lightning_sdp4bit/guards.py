"""What every rank must agree on before an optimizer step, decided by one small all-reduce.

After the gradient exchange each rank holds the averaged gradient of its own shards only, so
three facts about the step are global and must come out the same on every rank, or the ranks'
optimizer states (and then their collectives) would diverge:
- the global 2-norm of the gradient, for clipping;
- whether any gradient element is non-finite (Inf or NaN), for `SDP4BitConfig.nonfinite`;
- which trained parameters received a gradient on at least one rank in the accumulation window:
  the others get `grad = None`, so the optimizer skips them, as under DDP.

One all-reduce of a float vector [1 + P] (P trained parameters) carries all three: the sum of
squares of this rank's gradient shards, and one 0/1 entry per parameter. A non-finite gradient
element makes its shard's sum of squares Inf or NaN, which the sum carries to every rank; the
quantized exchanges carry it too, since an Inf or NaN makes its group's fp32 scale non-finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_sdp4bit import comm

__all__ = ["NonFiniteGradientError", "StepVerdict", "decide_step"]


class NonFiniteGradientError(FloatingPointError):
    """Raised on every rank, at the same step, when `nonfinite="error"` and a gradient is Inf or NaN."""


@dataclass(frozen=True)
class StepVerdict:
    norm: Tensor  # 0-dim fp32 on the gradients' device: the global 2-norm (Inf or NaN if non-finite)
    finite: bool  # every gradient element on every rank is finite
    used: tuple[bool, ...]  # per trained parameter: it received a gradient on some rank


def decide_step(grad_shards: list[Tensor], used_here: list[bool], group: Any) -> StepVerdict:
    """Collective over `group`: combine the ranks' gradient shards [S] and local usage flags.

    The squares are summed shard by shard, in bucket order, as a plain loop would, so that the
    norm is the one clipping used before this module existed (bit for bit).
    """
    device = grad_shards[0].device
    packed = torch.zeros(1 + len(used_here), dtype=torch.float32, device=device)
    for shard in grad_shards:
        packed[:1] += shard.pow(2).sum()
    packed[1:] = torch.tensor(used_here, dtype=torch.float32, device=device)
    comm.all_reduce(packed, group=group)
    on_host = packed.tolist()  # the step's one host synchronisation
    return StepVerdict(
        norm=packed[0].sqrt(), finite=math.isfinite(on_host[0]), used=tuple(count > 0 for count in on_host[1:])
    )
