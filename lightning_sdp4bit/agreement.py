"""Every rank must build the same model and `SDP4BitConfig`; what differs is named at setup.

Ranks whose buckets or configs differ would issue collectives that do not match: the job would
hang, or mix tensors silently. The engine checks at construction, in two steps:
1. every rank all-gathers one 63-bit digest of its bucket layouts and config (an int64 each, the
   only collective when the ranks agree);
2. only where a digest differs from rank 0's (every rank sees the same gathered digests, so all
   take this step together), the ranks all-gather their descriptions: each config field, then
   each trained parameter's shape and dtype by name, then each bucket. The error names, for each
   differing rank, the first entry in rank 0's order (then the other rank's) that differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_sdp4bit import comm
from lightning_sdp4bit.buffers import BucketLayout, layout_signature
from lightning_sdp4bit.config import SDP4BitConfig

__all__ = ["check_ranks_agree", "describe", "first_difference"]

# Differing ranks named in the error, at most (the others are counted).
_NAMED_RANKS = 4


# The kinds of entry a rank describes, in the order they are compared.
_KINDS = ("config field", "parameter", "bucket")


def describe(layouts: Sequence[BucketLayout], config: SDP4BitConfig) -> dict[tuple[str, str], str]:
    """What each rank must agree on, keyed by (kind, name): config fields, trained parameters (in
    bucket order; a parameter that is frozen or missing has no entry), buckets."""
    entries = {("config field", name): repr(value) for name, value in config.to_dict().items()}
    for bucket in layouts:
        for slot in bucket.slots:
            entries["parameter", slot.name] = f"shape {tuple(slot.shape)}, {bucket.dtype}"
    for index, bucket in enumerate(layouts):
        names = [slot.name for slot in bucket.slots]
        entries["bucket", str(index)] = f"{bucket.shard_numel} elements per shard, {bucket.dtype}, parameters {names}"
    return entries


def first_difference(reference: dict[tuple[str, str], str], other: dict[tuple[str, str], str], rank: int) -> str:
    """The first entry on which rank 0 (`reference`) and `rank` differ: config fields first,
    then parameters, then buckets, each kind in rank 0's order and then the other rank's."""
    keys = [*reference, *(key for key in other if key not in reference)]
    for key in sorted(keys, key=lambda key: _KINDS.index(key[0])):
        mine, theirs = reference.get(key), other.get(key)
        if mine != theirs:
            absent = "not trained (frozen or missing)" if key[0] == "parameter" else "absent"
            return f"{key[0]} {key[1]}: {mine or absent} on rank 0, {theirs or absent} on rank {rank}"
    return f"the bucket layouts' digests differ, although their descriptions agree, on rank {rank}"


def check_ranks_agree(
    layouts: Sequence[BucketLayout],
    config: SDP4BitConfig,
    world_size: int,
    group: Any,
    timeouts: comm.Timeouts,
    device: torch.device,
) -> None:
    """Raise a ValueError on every rank of `group` if any rank's layouts or config differ from
    rank 0's, naming the ranks and, for each, what differs first. Collective."""
    digest = layout_signature(layouts, extra=repr(sorted(config.to_dict().items())))
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    everyone = torch.empty(world_size, dtype=torch.int64, device=device)
    with timeouts.named("the all-gather that checks every rank built the same model and config"):
        comm.all_gather(everyone, mine, group=group)
    digests = everyone.tolist()
    differing = [rank for rank, value in enumerate(digests) if value != digests[0]]
    if not differing:
        return
    descriptions: list[Any] = [None] * world_size
    with timeouts.named("the all-gather of what each rank built, to name what differs"):
        dist.all_gather_object(descriptions, describe(layouts, config), group=group)
    named = [first_difference(descriptions[0], descriptions[rank], rank) for rank in differing[:_NAMED_RANKS]]
    more = f"; and {len(differing) - _NAMED_RANKS} more ranks" if len(differing) > _NAMED_RANKS else ""
    raise ValueError(
        f"ranks {differing} built a different model or SDP4BitConfig than rank 0: {'; '.join(named)}{more}. Every "
        "rank must build the same LightningModule with the same config."
    )
