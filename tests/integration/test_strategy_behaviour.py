"""SDP4BitStrategy inside Lightning: the distributed sampler is injected and sync_dist logging
syncs; gradient accumulation sends nothing on non-final micro-batches; clipping by value equals
DDP's bit for bit; bf16-mixed trains; devices=1 equals DDP on one device; the spawn
launcher works (and saving after a spawned fit says what it can write); ranks that build
different models fail at setup with a clear error instead of hanging; bad arguments and
precisions fail when the Trainer is built, and a ckpt_path with nothing to load when fit or
validate is called, before any process starts; a ckpt_path that only rank 1 cannot find names
rank 1 and the directory it looked in."""

import re
from datetime import timedelta

import pytest
import torch
from distributed import run_workers
from lightning_runs import TRAINER_DEFAULTS, ddp, make_trainer, sdp4bit, weights
from models import TinyLMModule, make_model


def _loop_behaviour(rank, world):
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DistributedSampler

    import lightning_sdp4bit.comm as comm

    events = []
    for name in ("reduce_scatter", "all_gather", "all_to_all"):
        original = getattr(comm, name)

        def counting(*args, _name=name, _original=original, **kwargs):
            events.append(_name)
            return _original(*args, **kwargs)

        setattr(comm, name, counting)

    class MarkBatches(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            events.append(f"end{batch_idx}")

    module = TinyLMModule()
    trainer = make_trainer(world, sdp4bit(preset="baseline"), max_steps=2, accumulate_grad_batches=3)
    trainer.callbacks.append(MarkBatches())
    trainer.fit(module)
    out = {
        "events": list(events),
        "buckets": len(trainer.strategy.engine.buckets),
        "sampler": isinstance(trainer.train_dataloader.sampler, DistributedSampler),
        "train_loss": float(trainer.callback_metrics["train_loss"]),
    }
    # Clip by value is elementwise, so it must equal DDP's exactly (global norm not involved).
    for strategy_name, strategy in (("ddp", ddp()), ("sdp4bit", sdp4bit(preset="baseline"))):
        module = TinyLMModule()
        trainer = make_trainer(world, strategy, max_steps=3, gradient_clip_val=0.01, gradient_clip_algorithm="value")
        trainer.fit(module)
        out[f"clip_value_{strategy_name}"] = weights(module)
    module = TinyLMModule()
    make_trainer(world, sdp4bit(), max_steps=3, precision="bf16-mixed").fit(module)
    out["bf16_mixed_finite"] = all(bool(torch.isfinite(w).all()) for w in weights(module).values())
    return out


def test_loop_behaviour_on_two_ranks():
    results = run_workers(_loop_behaviour, 2)
    for result in results:
        assert result["sampler"]
        events, buckets = result["events"], result["buckets"]
        # Setup: one all-gather of the layout digests. Then per step of 3 micro-batches: nothing
        # after micro-batches 0 and 1; after micro-batch 2, one reduce-scatter and one
        # all-gather per bucket.
        step = events[events.index("end1") + 1 : events.index("end2")]
        assert events[: events.index("end0")].count("reduce_scatter") == 0
        assert events.index("end1") == events.index("end0") + 1
        assert step.count("reduce_scatter") == buckets and step.count("all_gather") == buckets
        assert "all_to_all" not in events
        for name, expected in result["clip_value_ddp"].items():
            assert torch.equal(result["clip_value_sdp4bit"][name], expected), name
        assert result["bf16_mixed_finite"]
    # sync_dist=True: every rank logs the same mean loss.
    assert results[0]["train_loss"] == results[1]["train_loss"]


def _mismatched_models(rank, world):
    from lightning_sdp4bit import SDP4BitConfig
    from lightning_sdp4bit.engine import ShardedEngine
    from lightning_sdp4bit.topology import Topology, create_process_groups

    topology = Topology(rank, world, world)
    model = make_model(0, layers=2 + rank)  # rank 1 has one block more
    try:
        ShardedEngine(model, SDP4BitConfig(), topology, create_process_groups(topology))
    except ValueError as error:
        return str(error)
    return None


def test_ranks_with_different_models_fail_clearly_instead_of_hanging():
    messages = run_workers(_mismatched_models, 2)
    for message in messages:
        assert message is not None and "ranks [1] built a different model or SDP4BitConfig than rank 0" in message


def _one_rank(rank, world):
    out = {}
    for name, strategy in (("ddp", ddp()), ("sdp4bit", sdp4bit(preset="sdp4bit"))):
        module = TinyLMModule()
        make_trainer(world, strategy, max_steps=4, accumulate_grad_batches=2).fit(module)
        out[name] = weights(module)
    return out


def test_devices_1_equals_ddp_on_one_device():
    # One rank: nothing travels, so nothing is quantized, and the fp32 path is DDP's exactly.
    result = run_workers(_one_rank, 1)[0]
    for name, expected in result["ddp"].items():
        assert torch.equal(result["sdp4bit"][name], expected), name


def test_spawn_launcher_trains_and_returns_the_weights(tmp_path):
    import lightning.pytorch as pl

    from lightning_sdp4bit import SDP4BitStrategy

    module = TinyLMModule()
    before = weights(module)
    strategy = SDP4BitStrategy(config={"ranks_per_node": 1}, start_method="spawn")
    trainer = pl.Trainer(devices=2, strategy=strategy, max_steps=2, **TRAINER_DEFAULTS)
    trainer.fit(module)
    after = weights(module)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    with pytest.warns(UserWarning, match="no sharded training state in this process"):
        trainer.save_checkpoint(tmp_path / "after_spawn.ckpt")
    assert (tmp_path / "after_spawn.ckpt").is_file()


def test_bad_arguments_fail_before_any_process_starts():
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_sdp4bit import SDP4BitFabricStrategy, SDP4BitStrategy

    with pytest.raises(ValueError, match="weight_bits must be one of 2, 4, 8"):
        SDP4BitStrategy(config={"weight_bits": 3})
    with pytest.raises(ValueError, match="start_method must be one of"):
        SDP4BitStrategy(start_method="thread")
    for timeout in (30, timedelta(seconds=-5), timedelta(0)):
        with pytest.raises(ValueError, match=r"timeout must be a datetime.timedelta above zero, .*got"):
            SDP4BitStrategy(timeout=timeout)
        with pytest.raises(ValueError, match=r"timeout must be a datetime.timedelta above zero"):
            SDP4BitFabricStrategy(timeout=timeout)
    SDP4BitStrategy(timeout=None)  # the backend's default
    with pytest.raises(ValueError, match="ranks_per_node=3 must divide the world size 4"):
        pl.Trainer(accelerator="cpu", devices=4, strategy=SDP4BitStrategy(config={"ranks_per_node": 3}))
    strategy = SDP4BitStrategy()
    with pytest.raises(ValueError, match="precision='16-mixed' is not supported.*GradScaler skips steps"):
        strategy.precision_plugin = MixedPrecision("16-mixed", "cuda")
    with pytest.raises(ValueError, match="precision='64-true' is not supported"):
        pl.Trainer(accelerator="cpu", devices=2, strategy=SDP4BitStrategy(), precision="64-true")
    from lightning.fabric import Fabric

    from lightning_sdp4bit import SDP4BitFabricStrategy

    for strategy_class, build in ((SDP4BitStrategy, pl.Trainer), (SDP4BitFabricStrategy, Fabric)):
        with pytest.raises(ValueError, match=r"process_group_backend='mpi2': 'mpi2' is not a backend .*gloo"):
            build(accelerator="cpu", devices=2, strategy=strategy_class(process_group_backend="mpi2"))
        with pytest.raises(ValueError, match=r"process_group_backend='nccl'"):  # unavailable, or not CUDA devices
            build(accelerator="cpu", devices=2, strategy=strategy_class(process_group_backend="nccl"))
        build(accelerator="cpu", devices=2, strategy=strategy_class(process_group_backend="cpu:gloo"))


@pytest.mark.parametrize("entry", ["fit", "validate"])
def test_a_ckpt_path_with_nothing_to_load_fails_before_any_process_starts(tmp_path, entry):
    import lightning.pytorch as pl

    from lightning_sdp4bit import SDP4BitStrategy

    missing = tmp_path / "no_such.ckpt"
    settings = {**TRAINER_DEFAULTS, "limit_val_batches": 1}
    trainer = pl.Trainer(devices=2, strategy=SDP4BitStrategy(start_method="spawn"), **settings)
    # In the launching process: a worker's failure would come back as another exception type.
    with pytest.raises(FileNotFoundError, match=f"ckpt_path='{missing}' does not exist.*no process was started"):
        getattr(trainer, entry)(TinyLMModule(), ckpt_path=missing)


def test_ckpt_path_names_urls_and_none_are_left_to_lightning(tmp_path, monkeypatch):
    from lightning_sdp4bit.strategies import launchers
    from lightning_sdp4bit.strategies.launchers import check_ckpt_path

    def _fit_impl(model, train_dataloaders=None, val_dataloaders=None, datamodule=None, ckpt_path=None):
        """Lightning's signature: ckpt_path by name or by position."""

    for name in ("last", "best", "hpc", "registry:me/model", "s3://bucket/x.ckpt", None):
        check_ckpt_path(_fit_impl, None, ckpt_path=name)
    existing = tmp_path / "x.ckpt"
    existing.write_bytes(b"")
    check_ckpt_path(_fit_impl, None, None, None, None, existing)
    with pytest.raises(FileNotFoundError, match="x2.ckpt' does not exist"):
        check_ckpt_path(_fit_impl, None, None, None, None, tmp_path / "x2.ckpt")
    check_ckpt_path(lambda *a: None, 1, 2)  # no ckpt_path parameter: nothing to check
    # An interrupted first save complete at x3.ckpt.partial is loadable (checkpoint.find_checkpoint).
    partial = tmp_path / "x3.ckpt.partial"
    monkeypatch.setattr(launchers, "complete_partial", lambda path: partial if str(path).endswith("x3.ckpt") else None)
    check_ckpt_path(_fit_impl, None, ckpt_path=tmp_path / "x3.ckpt")


def test_a_ckpt_path_missing_on_one_rank_names_the_rank_and_its_directory(tmp_path):
    """fit(ckpt_path="rel.ckpt") under Lightning's popen launcher, the file in rank 0's working
    directory only: rank 1's error names it, the path and the directory it was resolved against
    (it read "no process was started", although rank 0 had started it)."""
    import subprocess
    import sys
    from pathlib import Path

    job = Path(__file__).resolve().parents[1] / "support" / "rank_directory_job.py"
    (tmp_path / "rank0").mkdir()
    (tmp_path / "rank1").mkdir()
    (tmp_path / "rank0" / "rel.ckpt").write_bytes(b"")  # rank 0 passes the check, then waits for rank 1
    finished = subprocess.run(
        [sys.executable, str(job), str(tmp_path / "rank1")],
        cwd=tmp_path / "rank0", capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    output = finished.stdout + finished.stderr
    assert finished.returncode != 0
    assert "no process was started" not in output, output[-3000:]
    expected = (
        "rank 1 on host .*: ckpt_path='rel.ckpt' does not exist, and no interrupted save left a complete "
        f"rel.ckpt.partial there: it looked for {tmp_path}/rank1/rel.ckpt \\(resolved against its working "
        f"directory {tmp_path}/rank1\\)"
    )
    assert re.search(expected, output), output[-3000:]
