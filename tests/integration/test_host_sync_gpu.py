"""On a GPU, a training step in its steady state makes no host synchronisation (skipped elsewhere).

Under `torch.cuda.set_sync_debug_mode("error")` a synchronising CUDA call (an `.item()` of a GPU
tensor, a blocking copy to the host, a `nonzero`) raises, naming where it was made. A
synchronisation lets the GPU drain while the host catches up: the host's lead over the GPU (the
emulated network's host table) falls to 0 at every step, and a host slower than the GPU's
forward then shows as idle gaps in it. Checked, after warm-up steps, as rank 0 of 2 nodes x 4
over the emulated network (benchmarks/emulation.py), with the GPT of its dry run:
- the engine's step in the order the Lightning adapter drives it (benchmarks/gpt_step.engine_step),
  under the uncompressed preset and sdp4bit, fused AdamW (which skips a non-finite step on the
  device);
- the same step through Lightning's Trainer (the benchmark's SDP4BitStrategy subclass, rank 0 of
  8: Lightning's own loop, its batch transfer from pinned memory and the adapter's hooks), from
  the start of the first checked step to the end of the last (not fit's teardown).
"""

import contextlib
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_sdp4bit.engine import ShardedEngine
from lightning_sdp4bit.topology import Topology

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from emulated_runs import MODELS, EmulatedStrategy, GPTModule, row_config, trainer_and_data  # noqa: E402
from emulation import Network  # noqa: E402
from gpt_step import engine_step, make_optimizer  # noqa: E402

WARMUP, CHECKED = 3, 2  # steps before the check (allocator, Triton's compilation), steps checked
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="gpu: synchronisation is a CUDA matter")


@contextlib.contextmanager
def _no_host_sync():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _network(device: torch.device) -> tuple[Topology, Network]:
    topology = Topology(0, 8, 4)
    network = Network(device, topology, "own")
    network.set_rates(150.0, 3.125, nvlink_us=2.0, nic_us=10.0)  # GB/s per GPU: the waits run on the GPU
    return topology, network


@GPU
@pytest.mark.parametrize("preset", ["baseline", "sdp4bit"])
def test_the_engines_step_makes_no_host_synchronisation(preset):
    device, spec = torch.device("cuda"), MODELS["tiny"]
    topology, network = _network(device)
    with network.install():
        model = spec.build(device)
        engine = ShardedEngine(model, row_config(preset, topology.ranks_per_node, None), topology, network.groups())
        optimizer = make_optimizer(model.parameters(), device)
        engine.shard_optimizer(optimizer)
        tokens = spec.tokens(device)
        for _ in range(WARMUP):
            engine_step(model, engine, optimizer, tokens)
        with _no_host_sync():
            for _ in range(CHECKED):
                engine_step(model, engine, optimizer, tokens)
        torch.cuda.synchronize()
        assert engine.step == WARMUP + CHECKED
        engine.close()


class _CheckFromWarmup(L.Callback):
    reads_weights = False  # sdp4bit: these hooks read no weights

    def __init__(self, checked: contextlib.ExitStack):
        self.checked = checked

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == WARMUP:
            self.checked.enter_context(_no_host_sync())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # The check ends with the last step: after fit, Lightning's teardown moves the optimizer's
        # state to the host (a blocking copy by design, once a run, not a step's).
        if batch_idx == WARMUP + CHECKED - 1:
            self.checked.close()


@GPU
def test_the_trainers_step_makes_no_host_synchronisation():
    device, spec = torch.device("cuda"), MODELS["tiny"]
    topology, network = _network(device)
    strategy = EmulatedStrategy(row_config("sdp4bit", topology.ranks_per_node, None), topology.world_size)
    steps = WARMUP + CHECKED
    with contextlib.ExitStack() as checked, network.install():
        trainer, data = trainer_and_data(spec, strategy, device, steps, _CheckFromWarmup(checked))
        trainer.fit(GPTModule(spec, device), data)
    assert trainer.global_step == steps
