"""One process as rank 0 of a job on the emulated network (benchmarks/emulation.py: loopback
collectives, here on the CPU and without link time), for tests of the engine without workers.
The loopbacks hand rank 0 its own data back as every peer's (a gathered bucket repeats its rows):
what the engine does is real, the values are not a real job's. Numerics: tests/multiprocess/."""

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def emulated_engine(benchmark_script, model: nn.Module, **config) -> Iterator:
    """`model`'s ShardedEngine as rank 0 of 2 nodes x 4, the sdp4bit preset with `config`'s
    changes; the emulation stays installed inside the block, and the engine is closed after it."""
    from lightning_sdp4bit.config import SDP4BitConfig
    from lightning_sdp4bit.engine import ShardedEngine
    from lightning_sdp4bit.topology import Topology

    topology = Topology(0, 8, 4)
    network = benchmark_script("emulation").Network(torch.device("cpu"), topology, "own")
    with network.install():
        engine = ShardedEngine(
            model, SDP4BitConfig.preset("sdp4bit", ranks_per_node=4, **config), topology, network.groups()
        )
        try:
            yield engine
        finally:
            engine.close()
