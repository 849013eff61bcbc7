"""Sharded checkpoints of SDP4BitStrategy: the directory layout (manifest.json + a generation
folder with meta.pt and one shard per rank); save at step N then resume to M equals a straight run to M, bit for bit,
uncompressed and compressed; resume on another world size; consolidation into one ordinary
checkpoint whose state_dict loads into the plain module and whose optimizer state loads into a
plain optimizer; an ordinary checkpoint resumes under sdp4bit, its global step restoring the
engine's step."""

import os

import pytest
import torch
from distributed import run_workers
from lightning_runs import make_trainer, sdp4bit, weights
from models import TinyLMModule

# 32 windows, batch 4: one epoch is 4 optimizer steps on 2 ranks.
STEPS_PER_EPOCH_2_RANKS = 4

# Lightning 2.6 does not replay the data order of a resumed epoch, nor the phase of gradient
# accumulation (DDPStrategy shows the same), so the resume tests feed one window repeated and
# step every batch: then only the restored training state can make runs differ.
DATA = dict(dataset_size=1, repeat=32)


def _fit(world, preset, steps, ckpt_path=None, save_to=None, **config):
    module = TinyLMModule(**DATA)
    trainer = make_trainer(world, sdp4bit(preset=preset, **config), max_steps=steps)
    trainer.fit(module, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return module, trainer


def _save_then_resume(rank, world, directory, preset):
    path = os.path.join(directory, "half.ckpt")
    straight, _ = _fit(world, preset, 2 * STEPS_PER_EPOCH_2_RANKS)
    _fit(world, preset, STEPS_PER_EPOCH_2_RANKS, save_to=path)
    listing = sorted(os.listdir(path)) + sorted(os.listdir(os.path.join(path, "gen_000000")))
    resumed, trainer = _fit(world, preset, 2 * STEPS_PER_EPOCH_2_RANKS, ckpt_path=path)
    return {
        "straight": weights(straight),
        "resumed": weights(resumed),
        "listing": listing,
        "siblings": sorted(os.listdir(directory)),
        "engine_step": trainer.strategy.engine.step,
    }


@pytest.mark.parametrize("preset", ["baseline", "sdp4bit"])
def test_save_then_resume_equals_a_straight_run(tmp_path, preset):
    results = run_workers(_save_then_resume, 2, str(tmp_path), preset)
    assert results[0]["listing"] == ["gen_000000", "manifest.json", "meta.pt", "shard_00000.pt", "shard_00001.pt"]
    assert results[0]["siblings"] == ["half.ckpt"]  # no .partial or .old left behind
    for result in results:
        assert result["engine_step"] == 2 * STEPS_PER_EPOCH_2_RANKS
        for name, expected in result["straight"].items():
            assert torch.equal(result["resumed"][name], expected), name


def _save(rank, world, path, preset):
    module, trainer = _fit(world, preset, STEPS_PER_EPOCH_2_RANKS, save_to=path)
    masters = {}
    for records in trainer.strategy.engine.fragments_by_name.values():
        for record in records:
            masters[(record.fragment.name, record.fragment.param_start)] = record.master.clone()
    return masters


def _resume_elsewhere(rank, world, path, preset):
    module = TinyLMModule(**DATA)
    trainer = make_trainer(world, sdp4bit(preset=preset, bucket_numel=5000), max_steps=STEPS_PER_EPOCH_2_RANKS + 1)
    loaded = {}

    def grab(*args):
        for records in trainer.strategy.engine.fragments_by_name.values():
            for record in records:
                loaded[(record.fragment.name, record.fragment.param_start)] = record.master.clone()

    module.on_train_start = grab
    trainer.fit(module, ckpt_path=path)
    return {"loaded": loaded, "global_step": trainer.global_step}


def _full(pieces_per_rank):
    """Reassemble {(name, start): slice} from every rank into {name: flat tensor}."""
    full = {}
    for pieces in pieces_per_rank:
        for (name, start), values in pieces.items():
            full.setdefault(name, {})[start] = values
    return {name: torch.cat([parts[s] for s in sorted(parts)]) for name, parts in full.items()}


@pytest.mark.parametrize("preset", ["baseline", "sdp4bit"])
def test_resume_on_another_world_size_and_bucket_size(tmp_path, preset):
    path = str(tmp_path / "w2.ckpt")
    saved = _full(run_workers(_save, 2, path, preset))
    resumed = run_workers(_resume_elsewhere, 4, path, preset)
    loaded = _full([r["loaded"] for r in resumed])
    assert saved.keys() == loaded.keys()
    for name in saved:
        assert torch.equal(saved[name], loaded[name]), name
    assert all(r["global_step"] == STEPS_PER_EPOCH_2_RANKS + 1 for r in resumed)


def _consolidate_and_reload(rank, world, path):
    from lightning_sdp4bit.checkpoint import consolidate_checkpoint

    module, trainer = _fit(world, "baseline", STEPS_PER_EPOCH_2_RANKS, save_to=path)
    if rank != 0:
        return None
    checkpoint = consolidate_checkpoint(path, path + ".consolidated")
    plain = TinyLMModule(**DATA)
    plain.load_state_dict(checkpoint["state_dict"], strict=True)
    optimizer = plain.configure_optimizers()["optimizer"]
    optimizer.load_state_dict(checkpoint["optimizer_states"][0])
    exp_avg = {id(p): s["exp_avg"] for p, s in optimizer.state.items()}
    return {
        "weights": weights(plain),
        "trained": weights(module),
        "exp_avg_shapes_match": all(exp_avg[id(p)].shape == p.shape for p in plain.parameters() if id(p) in exp_avg),
        "has_state_for_every_param": len(exp_avg) == len(list(plain.parameters())),
        "step": checkpoint["global_step"],
        "file": os.path.isfile(path + ".consolidated"),
    }


def test_consolidated_checkpoint_loads_into_the_plain_module_and_optimizer(tmp_path):
    result = run_workers(_consolidate_and_reload, 2, str(tmp_path / "c.ckpt"))[0]
    assert result["file"] and result["step"] == STEPS_PER_EPOCH_2_RANKS
    assert result["exp_avg_shapes_match"] and result["has_state_for_every_param"]
    # fp32 masters equal the fp32 weights of an uncompressed fp32 run.
    for name, expected in result["trained"].items():
        assert torch.equal(result["weights"][name], expected), name


def _resume_from_ordinary(rank, world, directory):
    from lightning_sdp4bit.checkpoint import consolidate_checkpoint

    sharded = os.path.join(directory, "s.ckpt")
    _fit(world, "baseline", STEPS_PER_EPOCH_2_RANKS, save_to=sharded)
    if rank == 0:
        consolidate_checkpoint(sharded, os.path.join(directory, "plain.ckpt"))
    torch.distributed.barrier()
    from_sharded, sharded_trainer = _fit(world, "baseline", 2 * STEPS_PER_EPOCH_2_RANKS, ckpt_path=sharded)
    from_plain, plain_trainer = _fit(
        world, "baseline", 2 * STEPS_PER_EPOCH_2_RANKS, ckpt_path=os.path.join(directory, "plain.ckpt")
    )
    steps = [t.strategy.engine.step for t in (sharded_trainer, plain_trainer)]
    return weights(from_sharded), weights(from_plain), steps


def test_an_ordinary_checkpoint_resumes_like_the_sharded_one(tmp_path):
    for from_sharded, from_plain, steps in run_workers(_resume_from_ordinary, 2, str(tmp_path)):
        for name, expected in from_sharded.items():
            assert torch.equal(from_plain[name], expected), name
        # The engine's step (which seeds stochastic rounding) continues from the checkpoint's
        # global step instead of restarting at 0 and repeating the first steps' random streams.
        assert steps == [2 * STEPS_PER_EPOCH_2_RANKS] * 2
