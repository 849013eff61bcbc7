"""SDP4BitFabricStrategy on CPU processes (fp32, 2 ranks, gloo): registered as Fabric's "sdp4bit";
with compression off it ends with Fabric's DDPStrategy's weights bit for bit (accumulation 2 under
no_backward_sync, clip by norm, AdamW with two groups, a per-step LR schedule); nothing is sent
during a no_backward_sync micro-batch (calls counted through a patched lightning_sdp4bit.comm);
fabric.save then fabric.load equals a straight run; fabric.all_reduce / broadcast / barrier work;
a Trainer-saved checkpoint resumes under Fabric and trains on like the Trainer, and a Fabric-saved
one resumes under the Trainer; an ordinary file saved by Fabric's DDPStrategy resumes too;
accumulation with every backward reduced (no no_backward_sync) equals Fabric's DDP bit for bit,
optimizer.zero_grad() (set_to_none True or False) reaches the engine and the missing-zero_grad
warning fires only without it; a penalty read before the forward reads current weights."""

import os
import warnings
from pathlib import Path

import pytest
import torch
from distributed import run_workers
from fabric_runs import make_fabric, sdp4bit, setup, train, weights

from lightning_sdp4bit.checkpoint import is_sharded_checkpoint


def _ddp_and_sdp4bit(rank, world, steps):
    from lightning.fabric.strategies import DDPStrategy

    out = {}
    for name, strategy in (("ddp", DDPStrategy()), ("sdp4bit", sdp4bit(preset="baseline"))):
        fabric = make_fabric(world, strategy)
        model, optimizer, schedule = setup(fabric)
        train(fabric, model, optimizer, schedule, range(steps))
        out[name] = weights(fabric, model)
    out["registry"] = type(make_fabric(world, "sdp4bit").strategy).__name__
    out["all_reduce"] = fabric.all_reduce(torch.tensor(rank + 1.0), reduce_op="sum").item()
    out["broadcast"] = fabric.broadcast(f"from {rank}", src=1)
    fabric.barrier()
    return out


def test_baseline_equals_fabric_ddp_bit_for_bit_and_collectives_work():
    results = run_workers(_ddp_and_sdp4bit, 2, 5)
    for result in results:
        assert result["registry"] == "SDP4BitFabricStrategy"
        assert result["all_reduce"] == 3.0 and result["broadcast"] == "from 1"
        for name, expected in result["ddp"].items():
            assert torch.equal(result["sdp4bit"][name], expected), name
    assert all(torch.equal(results[1]["sdp4bit"][n], w) for n, w in results[0]["sdp4bit"].items())


def _count_sends(rank, world, preset):
    from fabric_runs import loss_of
    from models import batch

    from lightning_sdp4bit import comm

    fabric = make_fabric(world, sdp4bit(preset=preset))
    model, optimizer, _ = setup(fabric)
    calls = []
    for name in ("all_gather", "all_reduce", "all_to_all", "broadcast", "reduce_scatter"):
        original = getattr(comm, name)
        setattr(comm, name, lambda *a, _name=name, _original=original, **k: calls.append(_name) or _original(*a, **k))
    counts = []
    for step in range(2):
        with fabric.no_backward_sync(model):
            fabric.backward(loss_of(model, batch(rank, step, 0), 1.0))
        counts.append(len(calls))
        fabric.backward(loss_of(model, batch(rank, step, 1), 1.0))
        counts.append(len(calls))
        optimizer.step()
        optimizer.zero_grad()
        counts.append(len(calls))
    return counts


@pytest.mark.parametrize("preset", ["baseline", "sdp4bit"])
def test_accumulation_sends_nothing_early(preset):
    for counts in run_workers(_count_sends, 2, preset):
        # step 0: nothing during the first micro-batch; gradients go with the second.
        assert counts[0] == 0 and counts[1] > 0
        # step 1: the weight all-gathers of step 0 were sent by optimizer.step, then nothing more
        # until the final micro-batch's backward.
        assert counts[2] > counts[1] and counts[3] == counts[2] and counts[4] > counts[3]


def _save_then_resume(rank, world, directory, preset):
    path = os.path.join(directory, "fabric.ckpt")
    fabric = make_fabric(world, sdp4bit(preset=preset))
    straight = setup(fabric)
    train(fabric, *straight, range(4))
    straight_weights = weights(fabric, straight[0])

    fabric = make_fabric(world, sdp4bit(preset=preset))
    model, optimizer, schedule = setup(fabric)
    train(fabric, model, optimizer, schedule, range(2))
    fabric.save(path, {"model": model, "optimizer": optimizer, "schedule": schedule, "step": 2})

    fabric = make_fabric(world, sdp4bit(preset=preset))
    model, optimizer, schedule = setup(fabric)
    state = {"model": model, "optimizer": optimizer, "schedule": schedule, "step": 0}
    remainder = fabric.load(path, state)
    train(fabric, model, optimizer, schedule, range(state["step"], 4))
    return {
        "straight": straight_weights,
        "resumed": weights(fabric, model),
        "step": state["step"],
        "remainder": remainder,
        "complete": is_sharded_checkpoint(path),
        "listing": sorted(p.name for p in Path(path).glob("gen_*/*")),
    }


@pytest.mark.parametrize("preset", ["baseline", "sdp4bit"])
def test_save_then_resume_equals_a_straight_run(tmp_path, preset):
    results = run_workers(_save_then_resume, 2, str(tmp_path), preset)
    assert results[0]["complete"] and results[0]["listing"] == ["meta.pt", "shard_00000.pt", "shard_00001.pt"]
    for result in results:
        assert result["step"] == 2 and result["remainder"] == {}
        for name, expected in result["straight"].items():
            assert torch.equal(result["resumed"][name], expected), name


# One window repeated, a step per batch: the Trainer's batches are then known to the Fabric loop.
DATA = dict(dataset_size=1, repeat=32)


def _trainer_to_fabric_and_back(rank, world, directory):
    from lightning_runs import make_trainer
    from lightning_runs import sdp4bit as trainer_sdp4bit
    from lightning_runs import weights as trainer_weights
    from models import TinyLMModule, TokenDataset

    trainer_path, fabric_path = os.path.join(directory, "trainer.ckpt"), os.path.join(directory, "fabric.ckpt")
    straight = TinyLMModule(**DATA)
    make_trainer(world, trainer_sdp4bit(preset="baseline"), max_steps=6).fit(straight)
    first = TinyLMModule(**DATA)
    trainer = make_trainer(world, trainer_sdp4bit(preset="baseline"), max_steps=4)
    trainer.fit(first)
    trainer.save_checkpoint(trainer_path)

    # The Trainer's checkpoint resumes under Fabric, scheduler included, and trains on like the Trainer.
    fabric = make_fabric(world, sdp4bit(preset="baseline"))
    module = TinyLMModule(**DATA)
    configured = module.configure_optimizers()
    model, optimizer = fabric.setup(module, configured["optimizer"])
    schedule = configured["lr_scheduler"]["scheduler"]
    remainder = fabric.load(trainer_path, {"model": model, "optimizer": optimizer})
    schedule.load_state_dict(remainder["lr_schedulers"][0])
    tokens = torch.stack([TokenDataset(size=1, repeat=32)[0]] * module.batch_size)
    for _ in range(2):
        fabric.backward(module.model.loss(tokens))
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    fabric.save(fabric_path, {"model": model, "optimizer": optimizer, "step": 6})

    # Fabric's checkpoint resumes under the Trainer: weights, masters and optimizer state.
    resumed = TinyLMModule(**DATA)
    trainer = make_trainer(world, trainer_sdp4bit(preset="baseline"), max_steps=1)
    restored = {}

    def grab(*args):
        engine = trainer.strategy.engine
        restored["step"] = engine.step
        restored["weights"] = trainer_weights(resumed)
        restored["exp_avg"] = [s["exp_avg"].clone() for s in trainer.strategy.optimizers[0].state.values()]

    resumed.on_train_start = grab
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(resumed, ckpt_path=fabric_path)
    fabric.strategy.wait_weights()
    return {
        "straight": trainer_weights(straight),
        "fabric": trainer_weights(module),
        "global_step": remainder["global_step"],
        "restored": restored,
        "fabric_exp_avg": [s["exp_avg"].clone() for s in optimizer.state.values()],
        "warned": any("was written by Fabric" in str(w.message) for w in caught),
    }


def test_trainer_checkpoint_resumes_under_fabric_and_back(tmp_path):
    results = run_workers(_trainer_to_fabric_and_back, 2, str(tmp_path))
    assert results[0]["warned"]  # rank 0 says what the Trainer does not resume
    for result in results:
        assert result["global_step"] == 4
        for name, expected in result["straight"].items():
            assert torch.equal(result["fabric"][name], expected), name
            assert torch.equal(result["restored"]["weights"][name], expected), name
        assert result["restored"]["step"] == 6
        assert all(
            torch.equal(a, b) for a, b in zip(result["restored"]["exp_avg"], result["fabric_exp_avg"], strict=True)
        )


def _from_an_ordinary_file(rank, world, directory):
    from lightning.fabric.strategies import DDPStrategy

    path = os.path.join(directory, "ddp.pt")
    fabric = make_fabric(world, DDPStrategy())
    model, optimizer, schedule = setup(fabric)
    train(fabric, model, optimizer, schedule, range(2))
    fabric.save(path, {"model": model, "optimizer": optimizer, "schedule": schedule, "step": 2})
    train(fabric, model, optimizer, schedule, range(2, 3))
    ddp_weights = weights(fabric, model)

    fabric = make_fabric(world, sdp4bit(preset="baseline"))
    model, optimizer, schedule = setup(fabric)
    remainder = fabric.load(path, {"model": model, "optimizer": optimizer, "schedule": schedule})
    train(fabric, model, optimizer, schedule, range(2, 3))
    return {"ddp": ddp_weights, "sdp4bit": weights(fabric, model), "remainder": remainder}


def test_an_ordinary_file_saved_by_fabric_ddp_resumes_under_sdp4bit(tmp_path):
    for result in run_workers(_from_an_ordinary_file, 2, str(tmp_path)):
        assert result["remainder"] == {"step": 2}
        for name, expected in result["ddp"].items():
            assert torch.equal(result["sdp4bit"][name], expected), name


_NO_ZERO_GRAD = "no zero_grad() in between"


def _fabric_contracts(rank, world):
    from lightning.fabric.strategies import DDPStrategy

    out = {}
    fabric = make_fabric(world, DDPStrategy())
    model, optimizer, schedule = setup(fabric)
    train(fabric, model, optimizer, schedule, range(3), no_sync=False)
    out["ddp"] = weights(fabric, model)
    for set_to_none in (True, False):
        fabric = make_fabric(world, sdp4bit(preset="baseline"))
        model, optimizer, schedule = setup(fabric)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(fabric, model, optimizer, schedule, range(3), no_sync=False, set_to_none=set_to_none)
        out[f"sdp4bit set_to_none={set_to_none}"] = weights(fabric, model)
        out[f"warned set_to_none={set_to_none}"] = sum(_NO_ZERO_GRAD in str(w.message) for w in caught)
    # A loop that really forgets zero_grad warns (once).
    from fabric_runs import loss_of
    from models import batch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            fabric.backward(loss_of(model, batch(rank, step), 0.05))
            optimizer.step()
    out["warned without zero_grad"] = sum(_NO_ZERO_GRAD in str(w.message) for w in caught)

    # An L2 penalty read before the forward, under the default compression: the current weights.
    fabric = make_fabric(world, sdp4bit())
    model, optimizer, _ = setup(fabric)
    out["penalties"] = []
    for step in range(3):
        penalty = sum((p**2).sum() for p in model.parameters())
        fabric.strategy.wait_weights()  # the oracle: every all-gather complete
        out["penalties"].append((penalty.item(), sum((p**2).sum() for p in model.parameters()).item()))
        fabric.backward(loss_of(model, batch(rank, step), 0.05) + 1e-3 * penalty)
        optimizer.step()
        optimizer.zero_grad()
    return out


def test_accumulation_without_no_backward_sync_equals_fabric_ddp_and_zero_grad_reaches_the_engine():
    """Every micro-batch's backward reduces (no no_backward_sync): the sum of all micro-batches
    trains, as under Fabric's DDP, with zero_grad() and zero_grad(set_to_none=False); the
    missing-zero_grad warning fires only in a loop that does not call it. A penalty over the
    parameters read before the forward reads the current weights."""
    for result in run_workers(_fabric_contracts, 2):
        assert len(result["penalties"]) == 3 and all(before == now for before, now in result["penalties"])
        for set_to_none in (True, False):
            assert result[f"warned set_to_none={set_to_none}"] == 0
            for name, expected in result["ddp"].items():
                assert torch.equal(result[f"sdp4bit set_to_none={set_to_none}"][name], expected), name
        assert result["warned without zero_grad"] == 1
