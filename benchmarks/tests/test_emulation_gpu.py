"""benchmarks/emulation.py on a GPU, where every lane is a CUDA stream (skipped elsewhere).

- a collective of host tensors (the preemption check's per-batch flag on its gloo group) runs
  inline and is charged its latency, without touching a stream;
- while the network link is recorded, each wait of its lanes (inter-node and world, not NVLink's)
  is bracketed by a pair of timing events, and stopping hands them over once;
- two-level exchanges' middle stage (gradients) and second stage (weights) queued on the engine's
  exchange stream give the host-driven results bit for bit, with four buckets in flight over slow
  links behind matmuls on the compute stream.
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lightning_sdp4bit.comm as comm
from lightning_sdp4bit.buffers import allocate_buckets, plan_buckets, shard_alignment
from lightning_sdp4bit.collectives import PlainGradReduceScatter, TwoLevelGradReduceScatter
from lightning_sdp4bit.config import SDP4BitConfig
from lightning_sdp4bit.schedule import exchange_stream
from lightning_sdp4bit.stats import WireMeter
from lightning_sdp4bit.topology import Topology
from lightning_sdp4bit.weight_collectives import PlainWeightAllGather, QuantizedWeightAllGather

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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


def _four_buckets_over_slow_links():
    """Rank 0 of 2 nodes x 4 on the GPU, links of 1 GB/s (NVLink) and 0.5 GB/s (NIC): about a
    millisecond per stage; four 32K-element bf16 buckets, one parameter each."""
    device = torch.device("cuda")
    topology = Topology(0, 8, 4)
    network = Network(device, topology)
    network.set_rates(1.0, 0.5)
    config = SDP4BitConfig(rounding="nearest")
    params = {f"p{i}": torch.nn.Parameter(torch.zeros(8 * 4096, dtype=torch.bfloat16, device=device)) for i in range(4)}
    layouts = plan_buckets([(n, tuple(p.shape), p.dtype) for n, p in params.items()], 8, 1, shard_alignment(config))
    buckets = allocate_buckets(layouts, params, 0)
    return device, topology, network, config, buckets, torch.Generator(device).manual_seed(0)


def _keep_busy(device: torch.device) -> None:
    """Long matmuls on the compute stream, with a temporary the allocator reuses afterwards."""
    busy = torch.randn(2048, 2048, device=device)
    for _ in range(8):
        busy = busy @ busy / 2048


@pytest.mark.skipif(not torch.cuda.is_available(), reason="gpu: the exchange stream exists on CUDA only")
@pytest.mark.parametrize("quantized", [True, False], ids=["TLq", "plain"])
def test_the_middle_stage_on_the_exchange_stream_gives_the_host_driven_shards(quantized):
    """Four buckets' two-level exchanges in flight at once over slow emulated links (each stage
    waits on the GPU for its bytes), behind long matmuls on the compute stream and with the
    allocator reusing memory: with the middle stage queued on the exchange stream, every
    gradient shard equals the one the host-driven exchange gives, bit for bit."""
    device, topology, network, config, buckets, generator = _four_buckets_over_slow_links()
    grads = [torch.randn(b.layout.numel, generator=generator, device=device).bfloat16() for b in buckets]
    shards = {}
    with network.install():
        for stream in (None, exchange_stream(device)):
            groups = network.groups()
            if quantized:
                collective = TwoLevelGradReduceScatter(config, topology, groups, WireMeter(), 0, stream)
            else:
                collective = PlainGradReduceScatter(topology, groups, WireMeter(), stream)
            pending = []
            for step, (bucket, grad) in enumerate(zip(buckets, grads, strict=True)):
                _keep_busy(device)
                pending.append(collective.start(bucket, grad.clone(), 1 / 8, step))
            for exchange in pending:
                exchange.wait()
            shards[stream is None] = [bucket.grad_shard.clone() for bucket in buckets]
    for host_driven, on_stream in zip(shards[True], shards[False], strict=True):
        assert torch.equal(host_driven.view(torch.int32), on_stream.view(torch.int32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="gpu: the exchange stream exists on CUDA only")
@pytest.mark.parametrize("quantized", [True, False], ids=["qWD", "plain"])
def test_the_weight_all_gathers_second_stage_on_the_exchange_stream_gives_the_host_driven_weights(quantized):
    """Four buckets' two-level weight all-gathers in flight at once (each stage waiting on the
    GPU for its bytes), behind matmuls on the compute stream: with the intra-node stage and then
    the copy into rank order (plain) or the dequantization of the rows where they landed (qWD)
    queued on the exchange stream, the weights equal the host-driven ones."""
    device, topology, network, config, buckets, generator = _four_buckets_over_slow_links()
    weights = [torch.randn(b.layout.numel, generator=generator, device=device).bfloat16() for b in buckets]
    masters = [torch.randn(b.master.shape, generator=generator, device=device) for b in buckets]
    results = {}
    with network.install():
        for stream in (None, exchange_stream(device)):
            groups = network.groups()
            if quantized:
                collective = QuantizedWeightAllGather(config, topology, groups, WireMeter(), True, stream)
            else:
                collective = PlainWeightAllGather(topology, groups, WireMeter(), stream)
            pending = []
            for step, (bucket, weight, master) in enumerate(zip(buckets, weights, masters, strict=True)):
                bucket.weights.copy_(weight)
                bucket.master.copy_(master)
                _keep_busy(device)
                pending.append(collective.start(bucket, step))
            for exchange in pending:
                exchange.wait()
            results[stream is None] = [bucket.weights.clone() for bucket in buckets]
    for host_driven, on_stream in zip(results[True], results[False], strict=True):
        assert torch.equal(host_driven.view(torch.int16), on_stream.view(torch.int16))
