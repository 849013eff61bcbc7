"""The simulation through the Trainer (`SDP4BitSimulationStrategy`) against a real Trainer job:
- 2 x 2 simulated on one CPU device and 4 gloo processes under `SDP4BitStrategy`, preset
  sdp4bit, bf16-true, accumulation 2, clipping by norm, 4 optimizer steps over 2 epochs (the
  DistributedSampler reshuffles): rank 0's per-step losses, final weights, fp32 master shards and
  optimizer state, and a buffer the step updates (DDP's broadcast_buffers: rank 0's), are equal
  bit for bit, and validation covers every rank's share;
- what it does not support is refused at setup, naming what to do.
"""

import pytest
import torch
from distributed import run_workers
from lightning_runs import TRAINER_DEFAULTS, make_trainer
from models import TinyLMModule

CONFIG = {"preset": "sdp4bit", "bucket_numel": 3000, "ranks_per_node": 2}
FIT = dict(max_steps=4, accumulate_grad_batches=2, gradient_clip_val=0.05, precision="bf16-true")


class _Record:
    def __init__(self):
        import lightning.pytorch as pl

        class Losses(pl.Callback):
            def __init__(self):
                self.losses = []

            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
                self.losses.append(outputs["loss"].item())

        self.callback = Losses()


def _state(trainer, module, engine, losses):
    optimizer = trainer.optimizers[0]
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    return {
        "losses": losses,
        "weights": {n: p.detach().clone() for n, p in module.named_parameters()},
        "buffers": {n: b.clone() for n, b in module.named_buffers()},
        "masters": [b.master.clone() for b in engine.buckets],
        "optimizer": optimizer.state_dict(),
    }


class _WithBuffer(TinyLMModule):
    """A buffer updated in every training step from the rank's own batch: DDP's broadcast_buffers
    makes every rank start each step from rank 0's."""

    def __init__(self):
        super().__init__(lr=3e-3, dataset_size=64)
        self.register_buffer("batch_mean", torch.zeros(()))

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            self.batch_mean.mul_(0.5).add_(batch.float().mean())
        return super().training_step(batch, batch_idx)


def _real(rank, world):
    import lightning_sdp4bit  # noqa: F401
    from lightning_sdp4bit import SDP4BitStrategy

    record = _Record()
    module = _WithBuffer()
    trainer = make_trainer(world, SDP4BitStrategy(config=CONFIG), callbacks=[record.callback], **FIT)
    trainer.fit(module)
    return _state(trainer, module, trainer.strategy.engine, record.callback.losses)


def _simulated(**overrides):
    import lightning.pytorch as pl

    from lightning_sdp4bit import SDP4BitSimulationStrategy

    record = _Record()
    module = _WithBuffer()
    settings = {**TRAINER_DEFAULTS, **FIT, "callbacks": [record.callback], **overrides}
    trainer = pl.Trainer(devices=1, strategy=SDP4BitSimulationStrategy("2x2", config=CONFIG), **settings)
    trainer.fit(module)
    return trainer, _state(trainer, module, trainer.strategy.engine, record.callback.losses)


def test_trainer_simulation_matches_a_real_trainer_job():
    real = run_workers(_real, 4)[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer, simulated = _simulated()
    finally:
        torch.set_num_threads(threads)
    assert len(simulated["losses"]) == 8 and simulated["losses"] == real["losses"]
    for name, weight in real["weights"].items():
        assert torch.equal(simulated["weights"][name], weight), name
    assert all(torch.equal(a, b) for a, b in zip(simulated["masters"], real["masters"], strict=True))
    assert torch.equal(simulated["buffers"]["batch_mean"], real["buffers"]["batch_mean"])
    for key, fields in real["optimizer"]["state"].items():
        for field, value in fields.items():
            assert torch.equal(simulated["optimizer"]["state"][key][field], value), (key, field)
    assert trainer.strategy.comm_stats["weight_bits_per_element"] == pytest.approx(4 + 32 / 2048)


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
    pl.Trainer(devices=1, strategy=SDP4BitSimulationStrategy("2x2", config=CONFIG), **settings).fit(module)
    # 16 validation windows, one batch of 4 per rank: every window once, not only rank 0's 4.
    expected = {tuple(w) for w in module.val_dataloader().dataset.tokens.tolist()}
    assert len(module.seen) == 16 and set(module.seen) == expected


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"enable_checkpointing": True}, "pass enable_checkpointing=False"),
        ({"gradient_clip_algorithm": "value"}, "clip by norm"),
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
