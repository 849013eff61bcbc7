"""The simulation through the Trainer (`SDP4BitSimulationStrategy`) against a real Trainer job:
- 2 x 2 and 2 x 4 simulated on one CPU device and 4 and 8 gloo processes under `SDP4BitStrategy`,
  preset sdp4bit, bf16-mixed, accumulation 2, clipping by norm, several buckets, 4 optimizer steps
  with a validation between them, a model with dropout drawn in training_step, a buffer its
  forward reads and updates, the LightningModule's own buffer read in training_step and a clamp
  of a weight in on_train_batch_end: every rank's per-micro-batch losses and buffers, weights,
  fp32 master shards and optimizer state are equal bit for bit, and each rank's step saw
  `trainer.global_rank` r and `trainer.world_size` W, as in its process;
- validation covers every rank's share;
- what it does not support is refused at setup, naming what to do.
"""

import os
import re

import pytest
import torch
from distributed import as_one_worker, run_workers
from lightning_runs import TRAINER_DEFAULTS, make_trainer
from models import TinyLMModule

FIT = dict(max_steps=4, accumulate_grad_batches=2, gradient_clip_val=0.05, precision="bf16-mixed")
# Validation after 4 batches: it draws between steps (each rank's iterator) and broadcasts buffers.
VALIDATE = dict(limit_val_batches=2, val_check_interval=4)


def _config(ranks_per_node: int) -> dict:
    return {"preset": "sdp4bit", "bucket_numel": 3000, "ranks_per_node": ranks_per_node}


class _Faithful(TinyLMModule):
    """What a simulation must reproduce rank by rank: dropout drawn in every step (each rank's own
    masks), a buffer of a submodule that its forward reads and updates (under accumulation, DDP
    broadcasts it before a window's first micro-batch only), a buffer of the LightningModule's own
    read and updated in training_step, and a weight write in a hook (a clamp after every batch).
    It records, per rank, its losses and its buffers after each step, and what the Trainer said
    its rank and world size were."""

    def __init__(self, world: int):
        super().__init__(lr=3e-3, dataset_size=16 * world)
        self.model.norm.register_buffer("seen", torch.zeros(()))
        self.model.norm.register_forward_pre_hook(self._read_and_update)
        self.register_buffer("running", torch.ones(()))
        self.records = []

    @staticmethod
    def _read_and_update(norm, args):
        with torch.no_grad():
            norm.seen.mul_(0.9).add_(args[0].float().abs().mean(), alpha=0.1)
        return (args[0] * (1 + 0.1 * norm.seen),)  # the forward reads it: the weights see it

    def training_step(self, batch, batch_idx):
        model = self.model
        x = model.embed(batch[:, :-1]) + model.position[: batch.shape[1] - 1]
        x = torch.nn.functional.dropout(x, 0.2, training=True)
        for block in model.blocks:
            x = block(x)
        logits = model.head(model.norm(x))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        with torch.no_grad():
            self.running.mul_(0.5).add_(loss.detach().float(), alpha=0.5)
        loss = loss * (1 + 0.01 * self.running)
        rank, world = self.trainer.global_rank, self.trainer.world_size
        self.records.append((rank, world, batch_idx, loss.item(), self.running.item(), model.norm.seen.item()))
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        with torch.no_grad():
            self.model.position.clamp_(-0.02, 0.02)


def _state(trainer, module, masters):
    optimizer = trainer.optimizers[0]
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    return {
        "records": module.records,
        "weights": {n: p.detach().clone() for n, p in module.named_parameters()},
        "masters": masters,
        "optimizer": optimizer.state_dict(),
    }


SEED = 7  # seed_everything's: both jobs' setup re-seeds every rank with it (Lightning's reset_seed)


def _real(rank, world, ranks_per_node):
    import lightning.pytorch as pl

    import lightning_sdp4bit  # noqa: F401
    from lightning_sdp4bit import SDP4BitStrategy

    pl.seed_everything(SEED, verbose=False)
    module = _Faithful(world)
    trainer = make_trainer(world, SDP4BitStrategy(config=_config(ranks_per_node)), **FIT, **VALIDATE)
    trainer.fit(module)
    return _state(trainer, module, [b.master.clone() for b in trainer.strategy.engine.buckets])


def _simulated(nodes, ranks_per_node):
    import lightning.pytorch as pl

    from lightning_sdp4bit import SDP4BitSimulationStrategy

    previous = os.environ.get("PL_GLOBAL_SEED")
    pl.seed_everything(SEED, verbose=False)
    try:
        module = _Faithful(nodes * ranks_per_node)
        strategy = SDP4BitSimulationStrategy((nodes, ranks_per_node), config=_config(ranks_per_node))
        trainer = pl.Trainer(devices=1, strategy=strategy, **{**TRAINER_DEFAULTS, **FIT, **VALIDATE})
        trainer.fit(module)
    finally:  # seed_everything's variable would re-seed later tests' strategies
        os.environ.pop("PL_GLOBAL_SEED", None)
        if previous is not None:
            os.environ["PL_GLOBAL_SEED"] = previous
    engine = trainer.strategy.engine
    states = []
    for rank in engine.ranks:
        state = _state(trainer, module, [b.master.clone() for b in rank.buckets])
        state["records"] = [r for r in module.records if r[0] == rank.topology.rank]
        state["optimizer"] = rank.optimizers[0].state_dict()
        states.append(state)
    return states


@pytest.mark.parametrize("nodes,ranks_per_node", [(2, 2), (2, 4)], ids=["2x2", "2x4"])
def test_trainer_simulation_matches_the_real_job_on_every_rank(nodes, ranks_per_node):
    world = nodes * ranks_per_node
    real = run_workers(_real, world, ranks_per_node)
    with as_one_worker():
        simulated = _simulated(nodes, ranks_per_node)
    for rank in range(world):
        mine, theirs = simulated[rank], real[rank]
        assert len(theirs["records"]) == 8 and {r[:2] for r in theirs["records"]} == {(rank, world)}
        assert mine["records"] == theirs["records"], rank  # losses and buffers of every micro-batch
        for name, weight in theirs["weights"].items():
            assert torch.equal(mine["weights"][name], weight), (rank, name)
        assert all(torch.equal(a, b) for a, b in zip(mine["masters"], theirs["masters"], strict=True)), rank
        for key, fields in theirs["optimizer"]["state"].items():
            for field, value in fields.items():
                assert torch.equal(mine["optimizer"]["state"][key][field], value), (rank, key, field)
    # The ranks drew different dropout masks and saw different data: their losses differ.
    assert len({theirs["records"][0][3] for theirs in real}) == world


class _SeenValidation(TinyLMModule):
    def __init__(self):
        super().__init__(lr=3e-3, dataset_size=64)
        self.seen = []

    def validation_step(self, batch, batch_idx):
        self.seen.extend(map(tuple, batch.tolist()))
        return super().validation_step(batch, batch_idx)


def test_validation_covers_every_rank_share():
    import lightning.pytorch as pl

    from lightning_sdp4bit import SDP4BitSimulationStrategy

    module = _SeenValidation()
    settings = {**TRAINER_DEFAULTS, **FIT, "limit_val_batches": None, "val_check_interval": 2, "max_steps": 1}
    pl.Trainer(devices=1, strategy=SDP4BitSimulationStrategy("2x2", config=_config(2)), **settings).fit(module)
    # 16 validation windows, one batch of 4 per rank: every window once, not only rank 0's 4.
    expected = {tuple(w) for w in module.val_dataloader().dataset.tokens.tolist()}
    assert len(module.seen) == 16 and set(module.seen) == expected


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"enable_checkpointing": True}, "pass enable_checkpointing=False"),
        ({"devices": 2}, "set devices=1"),
        ({"sync_batchnorm": True}, "sync_batchnorm=True is not supported"),
    ],
)
def test_unsupported_settings_are_refused_at_setup(overrides, message):
    import lightning.pytorch as pl

    from lightning_sdp4bit import SDP4BitSimulationStrategy

    settings = {**TRAINER_DEFAULTS, **FIT, **overrides}
    devices = settings.pop("devices", 1)
    trainer = pl.Trainer(devices=devices, strategy=SDP4BitSimulationStrategy("2x2"), **settings)
    with pytest.raises(ValueError, match=message):
        trainer.fit(TinyLMModule())


def test_a_ckpt_path_is_refused_before_any_step(tmp_path):
    import lightning.pytorch as pl
    import torch

    from lightning_sdp4bit import SDP4BitSimulationStrategy

    path = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {}}, path)  # a file Lightning would otherwise try to restore
    trainer = pl.Trainer(devices=1, strategy=SDP4BitSimulationStrategy("2x2"), **{**TRAINER_DEFAULTS, **FIT})
    module = TinyLMModule()
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(ValueError, match=r"resuming from ckpt_path='.*plain.ckpt' is not supported"):
        trainer.fit(module, ckpt_path=path)
    assert trainer.global_step == 0 and all(torch.equal(a, b) for a, b in zip(before, module.parameters()))


def test_bad_world_names_the_parameter():
    from lightning_sdp4bit import SDP4BitSimulationStrategy

    with pytest.raises(ValueError, match="simulate='16by4': expected 'MxL'"):
        SDP4BitSimulationStrategy("16by4")
    with pytest.raises(ValueError, match="2 ranks in all"):
        SDP4BitSimulationStrategy("1x1")
    with pytest.raises(ValueError, match=r"ranks_per_node=4 contradicts simulate=2x2, whose nodes have 2 ranks"):
        SDP4BitSimulationStrategy("2x2", config={"ranks_per_node": 4})  # not silently ignored
    for world in (4, (2, 2.5), (2,), "2x2x2", (True, 2), None):
        with pytest.raises(ValueError, match=r"simulate=.*: expected 'MxL' or \(M, L\): M nodes of L ranks each"):
            SDP4BitSimulationStrategy(world)


class _TwoTrainLoaders(TinyLMModule):
    def train_dataloader(self):
        return [super().train_dataloader(), super().train_dataloader()]

    def training_step(self, batch, batch_idx):
        return super().training_step(batch[0], batch_idx)


class _LBFGS(TinyLMModule):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.1)


class _SkipsAStep(TinyLMModule):
    def training_step(self, batch, batch_idx):
        return None  # on every rank: a real job whose ranks disagreed would hang in the exchange


REFUSED = [
    (_TwoTrainLoaders, ValueError, "got 2 train dataloaders; the simulation supports one"),
    (_LBFGS, ValueError, "LBFGS re-evaluates the loss inside optimizer.step"),
    (_SkipsAStep, RuntimeError, "Skipping the `training_step` by returning None in distributed training"),
]


def _real_refusals(rank, world):
    """What a real job says of the modules the simulation refuses (but the loaders, which it runs)."""
    import lightning_sdp4bit  # noqa: F401
    from lightning_sdp4bit import SDP4BitStrategy

    said = []
    for module_class, _, _ in REFUSED[1:]:
        try:
            make_trainer(world, SDP4BitStrategy(config=_config(world)), **FIT).fit(module_class())
            said.append(None)
        except Exception as caught:  # noqa: BLE001 - the error itself is the result
            said.append((type(caught).__name__, str(caught)))
    return said


def test_what_a_simulated_job_cannot_run_is_refused_before_its_first_step_as_the_real_job_refuses_it():
    import lightning.pytorch as pl

    from lightning_sdp4bit import SDP4BitSimulationStrategy

    real = run_workers(_real_refusals, 2)
    for module_class, error, message in REFUSED:
        module = module_class()
        before = [p.detach().clone() for p in module.parameters()]
        strategy = SDP4BitSimulationStrategy("1x2", config=_config(2))
        trainer = pl.Trainer(devices=1, strategy=strategy, **{**TRAINER_DEFAULTS, **FIT})
        with pytest.raises(error, match=re.escape(message)) as caught:
            trainer.fit(module)
        assert trainer.global_step == 0 and all(torch.equal(a, b) for a, b in zip(before, module.parameters()))
        if module_class is not _TwoTrainLoaders:
            said = real[0][REFUSED.index((module_class, error, message)) - 1]
            assert said is not None and said[0] == error.__name__ and message in said[1], said
            if module_class is _LBFGS:
                assert said[1] == str(caught.value).removeprefix("SDP4BitSimulationStrategy: ")
