"""Ranks whose training data end at different batches, named before their collectives part.

Without a DistributedSampler (`use_distributed_sampler=False`, per-rank datasets of different
lengths) one rank can run out of batches while the others go on. Under sharded data parallelism,
as under DDP, the others then wait in a collective it never joins, and learn of it only as a lost
connection once its process exits ("that process probably died"). A rank whose DataLoader has a
length knows its epoch's batches (`trainer.num_training_batches`), so the per-batch agreement of
`preemption.PreemptionSignal` also carries the most and the fewest batches any rank has. Where
they differ, every rank stops together at the start of the shortest rank's last batch with
`UnevenDataError`, which names the ranks, their batches and the step. A fit that `max_steps`
ends after that very batch on every rank goes on. A DataLoader without a length (an
IterableDataset) is not checked.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_sdp4bit import comm

__all__ = ["UnevenDataError", "agreement_values", "stop_if_uneven"]

# What a rank whose DataLoader has no length puts in the MAX all-reduce of lengths and of negated
# lengths: below any length, and below any negated one, so that it changes neither maximum.
_NO_LENGTH = -1
_NO_NEGATED_LENGTH = -(2**62)


class UnevenDataError(RuntimeError):
    """The ranks' training DataLoaders have different numbers of batches per epoch."""


def agreement_values(trainer: pl.Trainer) -> list[int]:
    """This rank's two entries of the per-batch MAX all-reduce: its batches per epoch and their
    negation (the maxima over the ranks: the most and minus the fewest)."""
    length = trainer.num_training_batches
    if not math.isfinite(length):
        return [_NO_LENGTH, _NO_NEGATED_LENGTH]
    return [int(length), -int(length)]


def stop_if_uneven(trainer: pl.Trainer, reduced: list[int], group: dist.ProcessGroup, timeouts: comm.Timeouts) -> None:
    """At the start of a training batch, with the agreement's maxima `reduced`: raise
    UnevenDataError on every rank at the shortest rank's last batch. Collective there (every rank
    sees the same maxima): one all-gather of the ranks' batch counts, to name them."""
    most, fewest = reduced[0], -reduced[1]
    if most == _NO_LENGTH or most == fewest:
        return
    batch = trainer.fit_loop.epoch_loop.batch_progress.current.ready  # 0-based, this epoch
    if batch != fewest - 1 or _max_steps_end_the_fit(trainer, batch):
        return
    mine = torch.tensor([agreement_values(trainer)[0]], dtype=torch.int64)
    lengths = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    with timeouts.named("the all-gather of the ranks' batches per epoch"):
        dist.all_gather(lengths, mine, group=group)
    counts = {rank: int(length) for rank, length in enumerate(lengths)}
    finishing = [rank for rank, count in counts.items() if count == fewest]
    going_on = ", ".join(f"rank {rank} has {count}" for rank, count in counts.items() if count > fewest)
    raise UnevenDataError(
        f"sdp4bit: ranks {finishing} finish their training data at step {trainer.global_step + 1} (their last "
        f"batch, {fewest} of epoch {trainer.current_epoch}) while the others go on ({going_on} batches per epoch). "
        "The likely cause: a DataLoader without a DistributedSampler (use_distributed_sampler=False, or "
        "per-rank datasets of different lengths). Every rank must run the same number of batches, as under "
        "DDP (a DistributedSampler, or equal per-rank splits); every rank stops here, before the others would "
        "wait for the finished ones in a collective."
    )


def _max_steps_end_the_fit(trainer: pl.Trainer, batch: int) -> bool:
    """Whether max_steps ends the fit after `batch` on every rank anyway: that batch makes an
    optimizer step on every rank (the shortest steps on its last batch, by Lightning's rule; the
    others at an accumulation boundary), and it is the last step."""
    boundary = (batch + 1) % trainer.accumulate_grad_batches == 0
    return trainer.max_steps >= 0 and boundary and trainer.global_step + 1 >= trainer.max_steps
