"""A state no skipped step can leave stops the run, on 2 CPU gloo ranks (nonfinite="skip", the
default), before any checkpoint holds it:
- a hook writes NaN into one weight, on rank 0 only and on every rank, in on_train_batch_end
  after step 3 of 10 under ModelCheckpoint(every_n_train_steps=2): every rank raises
  NonFiniteStateError in the next step (engine step 3, the first skipped), naming the parameter
  and where (weights or masters, which ranks); the checkpoint written before it is finite, and
  none is written after;
- gradients that stay non-finite with finite weights stop every rank after
  `nonfinite_skip_limit` steps skipped in a row, with the streak's first step;
- a save of non-finite weights is refused on every rank and leaves the checkpoint at its path
  as it was;
- one overflow, after which training goes on, is skipped and does not stop the run.
"""

import pytest
import torch
from distributed import run_workers
from lightning_runs import make_trainer, sdp4bit
from models import TinyLMModule


class _WritesNaN(TinyLMModule):
    def __init__(self, ranks):
        super().__init__(dataset_size=80)
        self.ranks = ranks

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.global_step == 3 and self.global_rank in self.ranks:
            with torch.no_grad():
                self.model.position[0, 0] = float("nan")


class _Overflows(TinyLMModule):
    """Its loss is Inf from step `start` on (or at that step only, with `once`)."""

    def __init__(self, start, once=False):
        super().__init__(dataset_size=80)
        self.start, self.once = start, once

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        hit = self.global_step == self.start if self.once else self.global_step >= self.start
        return loss * float("inf") if hit else loss


def _fit(module, world, directory=None, **config):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_sdp4bit.guards import NonFiniteGradientError, NonFiniteStateError

    callbacks = []
    if directory is not None:
        callbacks = [ModelCheckpoint(dirpath=directory, every_n_train_steps=2, save_top_k=-1)]
    trainer = make_trainer(
        world,
        sdp4bit(preset="sdp4bit", **config),
        max_steps=10,
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
    )
    try:
        trainer.fit(module)
    except (NonFiniteStateError, NonFiniteGradientError) as caught:
        return type(caught).__name__, str(caught), trainer.global_step
    return None, None, trainer.global_step


def _nan_writes(rank, world, directory):
    return {
        "rank 0": _fit(_WritesNaN({0}), world, f"{directory}/rank0"),
        "every rank": _fit(_WritesNaN({0, 1}), world, f"{directory}/all"),
    }


def test_a_nan_written_into_a_weight_stops_every_rank_before_a_checkpoint_holds_it(tmp_path):
    from lightning_sdp4bit.checkpoint import consolidate_checkpoint

    results = run_workers(_nan_writes, 2, str(tmp_path))
    for case, where in (("rank 0", "weights on ranks [0]"), ("every rank", "weights on ranks [0, 1]")):
        for rank, result in enumerate(results):
            kind, message, step = result[case]
            assert kind == "NonFiniteStateError", (case, rank, message)
            assert step == 3, (case, rank)  # the step after the write, not seven steps of skipping
            assert "after 1 optimizer step(s) skipped in a row since step 3" in message, message
            assert "'model.position' (" in message and where in message, message
        folder = tmp_path / ("rank0" if case == "rank 0" else "all")
        saved = sorted(folder.glob("*.ckpt"))
        assert [p.name for p in saved] == ["epoch=0-step=2.ckpt"], saved  # step 4's was never written
        for path in saved:
            state = consolidate_checkpoint(path)["state_dict"]
            assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point()), path


def _streak(rank, world):
    return {
        "lasting": _fit(_Overflows(start=2), world, nonfinite_skip_limit=3),
        "once": _fit(_Overflows(start=2, once=True), world, nonfinite_skip_limit=3),
        "no limit": _fit(_Overflows(start=2), world, nonfinite_skip_limit=0),
    }


def test_a_long_run_of_skipped_steps_stops_every_rank_and_one_overflow_does_not():
    for rank, result in enumerate(run_workers(_streak, 2)):
        kind, message, step = result["lasting"]
        assert kind == "NonFiniteGradientError", (rank, message)
        assert "3 optimizer step(s) skipped in a row since step 2" in message and "nonfinite_skip_limit=3" in message
        assert step == 4, rank  # steps 2, 3 and 4 skipped: stopped in the third
        assert result["once"] == (None, None, 10), rank
        assert result["no limit"] == (None, None, 10), rank


def _refused_save(rank, world, directory):
    from lightning_sdp4bit.guards import NonFiniteStateError

    module = TinyLMModule(dataset_size=80)
    trainer = make_trainer(world, sdp4bit(preset="sdp4bit"), max_steps=2)
    trainer.fit(module)
    path = f"{directory}/x.ckpt"
    trainer.save_checkpoint(path)
    with torch.no_grad():
        module.model.head.weight[rank, 0] = float("inf")  # the tied embedding: a weight every rank trains
    try:
        trainer.save_checkpoint(path)
        return None
    except NonFiniteStateError as caught:
        return str(caught)


def test_a_save_of_non_finite_weights_is_refused_on_every_rank_and_keeps_the_checkpoint(tmp_path):
    from lightning_sdp4bit.checkpoint import consolidate_checkpoint

    for said in run_workers(_refused_save, 2, str(tmp_path)):
        assert said is not None and "before a checkpoint is written" in said
        assert "'model.embed.weight' (" in said and "weights on ranks [0, 1])" in said, said
    state = consolidate_checkpoint(tmp_path / "x.ckpt")["state_dict"]
    assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())


@pytest.mark.parametrize("limit", [-1, 1.5, "3"])
def test_a_bad_skip_limit_names_the_field(limit):
    from lightning_sdp4bit import SDP4BitConfig

    with pytest.raises(ValueError, match="nonfinite_skip_limit"):
        SDP4BitConfig(nonfinite_skip_limit=limit)
