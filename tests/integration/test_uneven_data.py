"""Ranks whose training data end at different batches, on 2 ranks with
`use_distributed_sampler=False` and per-rank datasets of 6 and 3 batches:
- every rank stops at the start of rank 1's last batch with an UnevenDataError that names rank 1,
  the step its data end at and rank 0's batches (before, rank 1 finished its fit and rank 0 failed
  alone on the lost connection: "that process probably died");
- a fit that max_steps ends with that very batch runs to its end on both ranks.
"""

from datetime import timedelta

import torch
from distributed import run_workers
from lightning_runs import make_trainer
from models import TinyLMModule, TokenDataset

BATCHES = {0: 6, 1: 3}  # per rank, of 4 windows each


class UnevenData(TinyLMModule):
    """Each rank reads a dataset of its own length, as without a DistributedSampler."""

    def train_dataloader(self):
        return torch.utils.data.DataLoader(TokenDataset(4 * BATCHES[self.global_rank]), batch_size=4)


def _fit(rank, world, max_steps):
    from lightning_sdp4bit import SDP4BitStrategy

    # The timeout only keeps the old code (rank 0 waits for rank 1, which has finished) from hanging.
    strategy = SDP4BitStrategy(config={"bucket_numel": 3000}, timeout=timedelta(seconds=30))
    trainer = make_trainer(world, strategy, max_epochs=1, max_steps=max_steps, use_distributed_sampler=False)
    try:
        trainer.fit(UnevenData())
    except Exception as error:  # what each rank sees, whatever it is
        return f"{type(error).__name__}: {error}", trainer.global_step
    return None, trainer.global_step


def test_ranks_whose_data_end_at_different_batches_stop_together_naming_them():
    results = run_workers(_fit, 2, -1)
    for message, step in results:
        assert message is not None and message.startswith("UnevenDataError: sdp4bit: "), message
        assert "ranks [1] finish their training data at step 3 (their last batch, 3 of epoch 0)" in message, message
        assert "while the others go on (rank 0 has 6 batches per epoch)" in message
        assert "a DataLoader without a DistributedSampler" in message
        assert message == results[0][0] and step == 2  # both ranks, before rank 1's last batch


def test_a_fit_that_ends_with_the_shortest_ranks_last_batch_runs():
    assert run_workers(_fit, 2, BATCHES[1]) == [(None, 3), (None, 3)]
