"""Single-process simulations of the two compressed collectives, built from the reference ops.

They run all ranks' halves of a collective in one process, with the all-to-alls and the
all-gather done by indexing. The distributed tests compare the real multi-process collectives
against them bit for bit, so they must follow the same data flow: same chunk layout, same
order of sums, same seeds.

Ranks are numbered rank = node * L + local (L = ranks per node), as the launchers do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_sdp4bit.config import Rounding, coerce_enum
from lightning_sdp4bit.reference.ops import (
    torch_grad_decode_sum,
    torch_grad_encode,
    torch_grad_requantize,
    torch_weight_update_apply,
    torch_weight_update_encode,
)

__all__ = ["GradStage", "simulate_two_level_reduce_scatter", "simulate_weight_all_gather"]

SeedFn = Callable[[int, int], int]
"""seed_fn(rank, stage) -> the stochastic-rounding seed of that rank's stage."""


class GradStage:
    """Stage numbers that seed functions receive."""

    ENCODE = 1  # rotate + quantize + lay out, before the first all-to-all
    REQUANTIZE = 2  # dequantize + sum + re-quantize, between the two all-to-alls


def _no_seed(rank: int, stage: int) -> int:
    return 0


def simulate_two_level_reduce_scatter(
    grads: Sequence[Tensor],
    ranks_per_node: int,
    *,
    intra_bits: int,
    inter_bits: int,
    group_size: int,
    hadamard_size: int,
    rounding: Rounding | str = Rounding.NEAREST,
    seed_fn: SeedFn = _no_seed,
) -> list[Tensor]:
    """What each rank's TLq(-HS) reduce-scatter returns, given every rank's bucket gradient.

    grads: W tensors [N] (already divided by W, as the engine does), N a multiple of
    W * group_size. Returns W fp32 gradient shards [N / W]. One node runs only the intra stage
    (at intra_bits); one rank per node runs only the inter stage (at inter_bits).
    """
    rounding = coerce_enum("rounding", rounding, Rounding)
    world = len(grads)
    local, nodes = ranks_per_node, world // ranks_per_node
    if world == 1:
        return [grads[0].float().clone()]
    common: dict[str, Any] = dict(group_size=group_size, rounding=rounding)
    first_bits = intra_bits if local > 1 else inter_bits
    outer, chunks = (nodes, local) if local > 1 else (1, nodes)
    sent = [
        torch_grad_encode(g, outer, chunks, hadamard_size, first_bits, seed=seed_fn(rank, GradStage.ENCODE), **common)
        for rank, g in enumerate(grads)
    ]
    if local > 1:
        # Intra-node all-to-all: rank (n, l) gets chunk l from every peer (n, 0..L-1), in order.
        received = [
            torch.stack([sent[(r // local) * local + peer][r % local] for peer in range(local)]) for r in range(world)
        ]
        if nodes == 1:
            return [torch_grad_decode_sum(p, intra_bits, group_size, hadamard_size) for p in received]
        sent = [
            torch_grad_requantize(
                received[rank], intra_bits, inter_bits, outer=nodes, seed=seed_fn(rank, GradStage.REQUANTIZE), **common
            )
            for rank in range(world)
        ]
    # Inter-node all-to-all among equal local indices: rank (n, l) gets chunk n from (0..M-1, l).
    received = [
        torch.stack([sent[node * local + r % local][r // local] for node in range(nodes)]) for r in range(world)
    ]
    return [torch_grad_decode_sum(p, inter_bits, group_size, hadamard_size) for p in received]


def simulate_weight_all_gather(
    master_shards: Sequence[Tensor],
    weights: Tensor,
    *,
    additive: bool,
    bits: int,
    group_size: int,
    rounding: Rounding | str = Rounding.NEAREST,
    seed_fn: Callable[[int], int] = lambda rank: 0,
) -> Tensor:
    """The model weights every rank holds after a quantized weight all-gather.

    master_shards: W fp32 [S]; weights: [W*S], the weights all ranks hold before (unchanged here).
    additive=True is qWD (differences against `weights`), False is qW (the values themselves).
    """
    shard = weights.numel() // len(master_shards)
    payloads = [
        torch_weight_update_encode(
            master,
            weights[rank * shard : (rank + 1) * shard] if additive else None,
            bits,
            group_size,
            rounding,
            seed_fn(rank),
        )
        for rank, master in enumerate(master_shards)
    ]
    return torch_weight_update_apply(torch.cat(payloads), weights.clone(), bits, group_size, additive)
