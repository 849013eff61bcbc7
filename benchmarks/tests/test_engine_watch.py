"""benchmarks/emulated_runs.marking_the_turn, how the emulated-network benchmark marks the turn
from forward to backward with hooks of its own (it replaces nothing of the engine's):
- in a step of a real engine (one rank, baseline), "last_weights" is marked once, when the
  forward reaches the first module owning a parameter of bucket 0, after the engine's own
  pre-hook has run there, and "first_gradients" once, when the last of bucket 0's gradients has
  been handed to the engine; a new step marks both again;
- on leaving, even by an exception, the benchmark's hooks are gone (no point in a later step),
  and the engine's class methods were never shadowed on the instance.
"""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from emulated_runs import marking_the_turn  # noqa: E402


class _Timer:
    def __init__(self):
        self.points = []

    def point(self, name):
        self.points.append(name)


def _engine(monkeypatch):
    from lightning_sdp4bit import SDP4BitConfig, comm
    from lightning_sdp4bit.engine import ShardedEngine
    from lightning_sdp4bit.topology import ProcessGroups, Topology

    class _Done:
        def wait(self):
            return True

        def is_completed(self):
            return True

    def done(*args, async_op=False, **kwargs):  # a job of one rank: every collective is complete at once
        return _Done() if async_op else None

    for name in ("all_gather", "all_reduce", "broadcast", "reduce_scatter", "all_to_all"):
        monkeypatch.setattr(comm, name, done)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    config = SDP4BitConfig.preset("baseline", bucket_numel=72)  # the last Linear alone in bucket 0
    engine = ShardedEngine(model, config, Topology(0, 1, 1), ProcessGroups(world=None, intra=None, inter=None))
    return model, engine


def test_the_turn_is_marked_once_per_step_by_hooks_of_its_own(monkeypatch):
    model, engine = _engine(monkeypatch)
    assert {id(p) for p in engine.buckets[0].params} == {id(p) for p in model[2].parameters()}
    timer, seen = _Timer(), []
    with pytest.raises(RuntimeError, match="a failing step"), marking_the_turn(model, engine, timer) as new_step:
        for module in (model[0], model[2]):  # after the benchmark's own pre-hooks
            module.register_forward_pre_hook(lambda module, args: seen.append(list(timer.points)))
        for _ in range(2):
            new_step()
            engine.pre_backward()
            model(torch.randn(4, 8)).square().sum().backward()
            engine.post_backward()
        assert timer.points == ["last_weights", "first_gradients"] * 2
        assert seen[0] == [] and seen[1] == ["last_weights"]  # reached at the last Linear, not before
        raise RuntimeError("a failing step")
    engine.pre_backward()
    model(torch.randn(4, 8)).square().sum().backward()
    assert timer.points == ["last_weights", "first_gradients"] * 2  # the hooks are gone
    assert not {"wait_weights", "on_grad_ready", "post_backward"} & set(vars(engine))
    engine.close()
