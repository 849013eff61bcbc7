"""Checkpoints under weight_sharding="node" never gather a bucket outside the training step, on 4
gloo processes as 2 nodes x 2 (every gather counted where it starts, `NodeShards._start`):
- Fabric: fabric.save writes without a gather (it used to wait forever: rank 0, writing meta.pt
  alone, read every parameter, and each read gathered a bucket its node's other rank never
  joined), and the checkpoint loads into a fresh node-sharded job, without a gather, to the
  saved weights;
- Fabric: an ordinary file (Fabric's DDPStrategy's) restores the module's buffers with its
  weights, without a gather; a buffer the file lacks is refused, naming it;
- the Trainer: save_checkpoint in the middle of fit (Lightning's dump of the module's state
  included), the resume from it and the resume from its consolidated file gather nothing, and
  both resumes end with the same weights (preset baseline, whose weights are the masters).
"""

import contextlib
import os

import lightning.pytorch as pl
import torch
from distributed import run_workers
from fabric_runs import make_fabric, sdp4bit, setup, train, weights
from lightning_runs import make_trainer
from lightning_runs import sdp4bit as trainer_sdp4bit
from lightning_runs import weights as trainer_weights
from models import TinyLMModule, make_model

NODE = dict(preset="sdp4bit", ranks_per_node=2, weight_sharding="node")


@contextlib.contextmanager
def counting_gathers():
    from lightning_sdp4bit.node_shards import NodeShards

    started, start = [], NodeShards._start
    NodeShards._start = lambda self, index: (started.append(index), start(self, index))[1]
    try:
        yield started
    finally:
        NodeShards._start = start


def _fabric_round_trip(rank, world, directory):
    path = os.path.join(directory, "node.ckpt")
    fabric = make_fabric(world, sdp4bit(**NODE))
    model, optimizer, schedule = setup(fabric)
    train(fabric, model, optimizer, schedule, range(2))
    with counting_gathers() as saving:
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2})
    saved = weights(fabric, model)
    fabric = make_fabric(world, sdp4bit(**NODE))
    model, optimizer, schedule = setup(fabric)
    with counting_gathers() as loading:
        remainder = fabric.load(path, {"model": model, "optimizer": optimizer})
    return {"saving": saving, "loading": loading, "saved": saved, "loaded": weights(fabric, model), "rest": remainder}


def test_fabric_saves_and_loads_a_node_sharded_job_without_a_gather(tmp_path):
    for result in run_workers(_fabric_round_trip, 4, str(tmp_path)):
        assert result["saving"] == [] and result["loading"] == [] and result["rest"] == {"step": 2}
        for name, weight in result["saved"].items():
            assert torch.equal(result["loaded"][name], weight), name


def _with_a_buffer(fabric, value: float):
    model = make_model(0)
    model.register_buffer("seen", torch.full((3,), value))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return fabric.setup(model, optimizer)


def _ordinary_file_with_a_buffer(rank, world, directory):
    from lightning.fabric.strategies import DDPStrategy

    path = os.path.join(directory, "ddp.pt")
    fabric = make_fabric(world, DDPStrategy())
    model, optimizer = _with_a_buffer(fabric, 7.0)
    fabric.save(path, {"model": model, "optimizer": optimizer})
    expected = weights(fabric, model)
    fabric = make_fabric(world, sdp4bit(**NODE))
    model, optimizer = _with_a_buffer(fabric, 0.0)
    with torch.no_grad():
        for param in model.module.parameters():
            param.zero_()
    with counting_gathers() as loading:
        fabric.load(path, {"model": model, "optimizer": optimizer})
    out = {"loading": loading, "seen": model.module.seen.clone(), "expected": expected}
    out["loaded"] = weights(fabric, model)
    model.module.register_buffer("unsaved", torch.zeros(2))
    try:
        fabric.load(path, {"model": model, "optimizer": optimizer})
    except Exception as error:  # noqa: BLE001 (the message is what is checked)
        out["refused"] = str(error)
    return out


def test_fabric_loads_an_ordinary_files_buffers_without_a_gather(tmp_path):
    for result in run_workers(_ordinary_file_with_a_buffer, 4, str(tmp_path)):
        assert result["loading"] == []
        assert torch.equal(result["seen"], torch.full((3,), 7.0))
        for name, weight in result["expected"].items():
            assert torch.equal(result["loaded"][name], weight), name
        assert "missing ['unsaved']" in result["refused"]


class SaveInTheMiddle(pl.Callback):
    def __init__(self, path):
        self.path, self.gathers = path, None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == 2 and self.gathers is None:
            with counting_gathers() as gathers:
                trainer.save_checkpoint(self.path)
            self.gathers = list(gathers)


def _node_trainer(world, steps, **kwargs):
    # baseline: the weights equal the masters, which a consolidated file holds, so both resumes agree
    strategy = trainer_sdp4bit(**{**NODE, "preset": "baseline"})
    loads = []
    load = strategy.load_model_state_dict

    def counted(*args, **kw):
        with counting_gathers() as gathers:
            load(*args, **kw)
        loads.append(list(gathers))

    strategy.load_model_state_dict = counted
    return make_trainer(world, strategy, max_steps=steps, **kwargs), loads


def _save_in_fit(rank, world, path):
    callback = SaveInTheMiddle(path)
    trainer, _ = _node_trainer(world, 4, callbacks=[callback])
    trainer.fit(TinyLMModule(dataset_size=1, repeat=64))
    return callback.gathers


def _resume(rank, world, path):
    module = TinyLMModule(dataset_size=1, repeat=64)
    trainer, loads = _node_trainer(world, 4)
    trainer.fit(module, ckpt_path=path)
    return {"loads": loads, "weights": trainer_weights(module)}


def test_the_trainer_saves_and_resumes_a_node_sharded_job_without_a_gather(tmp_path):
    from lightning_sdp4bit.checkpoint import consolidate_checkpoint

    path, plain = str(tmp_path / "node.ckpt"), str(tmp_path / "plain.ckpt")
    assert run_workers(_save_in_fit, 4, path) == [[], [], [], []]
    consolidate_checkpoint(path, plain)
    sharded, ordinary = run_workers(_resume, 4, path), run_workers(_resume, 4, plain)
    for one, other in zip(sharded, ordinary, strict=True):
        assert one["loads"] == [[]] and other["loads"] == [[]]
        for name, weight in one["weights"].items():
            assert torch.equal(other["weights"][name], weight), name
