"""benchmarks/emulation.py on a GPU, where every lane is a CUDA stream (skipped elsewhere).

- a collective of host tensors (the preemption check's per-batch flag on its gloo group) runs
  inline and is charged its latency, without touching a stream;
- while the network link is recorded, each wait of its lanes (inter-node and world, not NVLink's)
  is bracketed by a pair of timing events, and stopping hands them over once.
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lightning_sdp4bit.comm as comm
from lightning_sdp4bit.topology import Topology

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from emulation import Network  # noqa: E402


@pytest.mark.skipif(not torch.cuda.is_available(), reason="gpu: on the CPU every lane runs inline")
def test_a_host_tensor_collective_waits_on_the_host_on_a_gpu_network():
    """The preemption check all-reduces a one-int CPU flag on a gloo group every batch: on a GPU
    network it runs inline and is charged, with no stream (record_stream has no CPU kernel)."""
    network = Network(torch.device("cuda"), Topology(0, 64, 4), "own")
    network.set_rates(150.0, 3.125, nvlink_us=2.0, nic_us=10.0)
    flag = torch.ones(1, dtype=torch.int32)
    with network.install():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    assert flag.item() == 1 and network.lightning.ops == 1
    assert network.lightning.latency_ns == 2 * 3 * 2000 + 2 * 4 * 10000  # a tree: 3 NVLink, 4 NIC steps each way


@pytest.mark.skipif(not torch.cuda.is_available(), reason="gpu: CUDA events bracket the waits on a GPU only")
def test_recording_brackets_every_wait_of_the_network_link_on_a_gpu():
    """Each collective on the NIC's lanes (inter-node and world) gets a (start, end) pair of timing
    events on its lane's stream; NVLink's lane is not the network link across nodes."""
    network = Network(torch.device("cuda"), Topology(0, 8, 4))
    network.set_rates(150.0, 3.125)
    groups = network.groups()
    payload, gathered = torch.ones(1024, device="cuda"), torch.empty(2 * 1024, device="cuda")
    network.record_network_link(True)
    with network.install():
        comm.all_gather(gathered, payload, group=groups.inter)
        comm.all_gather(torch.empty(4 * 1024, device="cuda"), payload, group=groups.intra)
        comm.all_reduce(payload, group=groups.world)
    recorded = network.record_network_link(False)
    torch.cuda.synchronize()
    assert len(recorded) == 2
    assert all(start.elapsed_time(end) >= 0 for start, end in recorded)
    assert network.inter.recorded is None and network.record_network_link(False) == []
