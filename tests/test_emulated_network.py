"""benchmarks/emulated_network.py and its emulation (benchmarks/emulation.py), on the CPU.

Checks:
- each loopback collective writes rank 0's share of the result (all-gather repeats the input,
  reduce-scatter keeps the first chunk, all-to-all copies, all-reduce sums identical ranks) and
  is charged the ring's bytes per rank for its group's size, on its group's lane;
- the fake process groups take the shapes of the real ones (a stage spanning the world is the
  world group, an absent one None, with one node and with one rank per node), and a group the
  emulation does not know goes to the world lane;
- torch.distributed calls made outside comm (Lightning's) take the world lane, or their own
  lane with lightning_lane="own", and are counted; Network.install restores everything;
- bad arguments stop the script with a message that names the flag;
- the dry run (tiny GPT, CPU) prints a table per scenario, with every row, Lightning's
  per-batch broadcast routed through the emulated world link, and writes the same text to
  --markdown. Its figures are not timings and nothing here asserts on them;
- activation checkpointing (gpt_step.build_gpt): parameter names and gradients unchanged, each
  block's modules run forward twice;
- on a GPU, the middle stage of two-level exchanges queued on the engine's exchange stream gives
  the host-driven exchange's gradient shards bit for bit, with several exchanges in flight, and
  the second stage of two-level weight all-gathers (qWD and plain) the host-driven weights.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lightning_sdp4bit.comm as comm
from lightning_sdp4bit.buffers import allocate_buckets, plan_buckets
from lightning_sdp4bit.collectives import PlainGradReduceScatter, TwoLevelGradReduceScatter
from lightning_sdp4bit.config import SDP4BitConfig
from lightning_sdp4bit.engine import shard_alignment
from lightning_sdp4bit.schedule import exchange_stream
from lightning_sdp4bit.stats import WireMeter
from lightning_sdp4bit.topology import Topology
from lightning_sdp4bit.weight_collectives import PlainWeightAllGather, QuantizedWeightAllGather

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from emulation import Network  # noqa: E402

CPU = torch.device("cpu")


def _network(world=8, ranks_per_node=4, lightning_lane="shared"):
    network = Network(CPU, Topology(0, world, ranks_per_node), lightning_lane)
    network.set_rates(1.0, 1.0)  # 1 GB/s = 1 byte per ns: busy_ns counts bytes
    return network


def test_loopbacks_write_rank_zeros_share_and_charge_ring_bytes():
    network = _network()
    groups = network.groups()
    x = torch.arange(6, dtype=torch.float32)
    gathered = torch.empty(8 * 6)
    assert comm.all_gather is not network.all_gather  # nothing patched outside install()
    with network.install():
        comm.all_gather(gathered, x, group=groups.world, async_op=True).wait()
        assert torch.equal(gathered, x.repeat(8))
        assert network.world.busy_ns == 7 / 8 * gathered.nbytes

        shard = torch.empty(6)
        assert comm.reduce_scatter(shard, gathered + 1, group=groups.world) is None  # synchronous
        assert torch.equal(shard, x + 1)
        assert network.world.busy_ns == 2 * 7 / 8 * gathered.nbytes

        payload, received = torch.arange(12, dtype=torch.uint8), torch.empty(12, dtype=torch.uint8)
        comm.all_to_all(received, payload, group=groups.intra, async_op=True).wait()
        assert torch.equal(received, payload) and network.intra.busy_ns == 3 / 4 * 12
        comm.all_to_all(received, payload, group=groups.inter, async_op=True).wait()
        assert network.inter.busy_ns == 1 / 2 * 12

        total = torch.ones(2)
        comm.all_reduce(total, group=groups.world)
        assert torch.equal(total, torch.full((2,), 8.0))  # the sum of 8 identical ranks
        comm.broadcast(total, src=0, group=object())  # a group the emulation does not know
        assert network.world.ops == 4 and network.lightning_ops == 0
    assert comm.all_gather is not network.all_gather  # restored
    assert network.world.busy_ns == 2 * 7 / 8 * gathered.nbytes + 2 * 7 / 8 * 8 + 8
    links = network.link_busy_ns()
    assert links["nic"] == links["inter"] + links["world"] and links["nvlink"] == links["intra"]


@pytest.mark.parametrize("world, ranks_per_node", [(8, 4), (8, 8), (8, 1)])
def test_fake_groups_take_the_shapes_of_the_real_ones(world, ranks_per_node):
    network = _network(world, ranks_per_node)
    groups = network.groups()
    assert groups.world.lane is network.world and groups.world.size() == world
    nodes = world // ranks_per_node
    if nodes == 1:
        assert groups.inter is None and groups.intra is groups.world
    elif ranks_per_node == 1:
        assert groups.intra is None and groups.inter is groups.world
    else:
        assert (groups.intra.lane, groups.intra.size()) == (network.intra, ranks_per_node)
        assert (groups.inter.lane, groups.inter.size()) == (network.inter, nodes)
    with pytest.raises(ValueError, match="emulates"):
        network.groups(Topology(0, world * 2, ranks_per_node))


@pytest.mark.parametrize("lane", ["shared", "own"])
def test_lightning_collectives_take_the_world_lane_or_their_own(lane):
    network = _network(lightning_lane=lane)
    flag = torch.zeros(1, dtype=torch.int64)
    real = dist.broadcast
    with network.install():
        dist.broadcast(flag, src=0)  # Lightning's per-batch SIGTERM broadcast
        dist.barrier()
        dist.all_reduce(flag)
        assert flag.item() == 0  # Lightning divides by the real one-rank group's size: left as is
    assert dist.broadcast is real
    assert network.lightning_ops == 3
    assert (network.lightning is network.world) == (lane == "shared")
    assert network.lightning.ops == 3 and network.lightning.busy_ns == 8 + 2 * 7 / 8 * 8
    assert network.link_busy_ns()["world"] == network.lightning.busy_ns


def _script(*args):
    command = [sys.executable, str(BENCHMARKS / "emulated_network.py"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--world", "6"], "--ranks-per-node=4 must divide --world=6"),
        (["--scenarios", "custom"], "the custom scenario needs --link-gbps"),
        (["--presets", "sdp4bit,fast"], "--presets: fast not among"),
        (["--model", "356m"], "--dry-run runs the tiny model on the CPU"),
    ],
)
def test_bad_arguments_name_the_flag(args, message, capsys):
    import emulated_network

    with pytest.raises(SystemExit) as stopped:
        emulated_network.parse_args(["--dry-run", *args])
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_dry_run_prints_every_table(tmp_path):
    out = tmp_path / "out.md"
    presets = ["--presets", "baseline,sdp4bit", "--trainer-presets", "sdp4bit"]
    result = _script("--dry-run", *presets, "--scenarios", "eth100", "--link-gbps", "200", "--markdown", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    text = result.stdout
    assert "Dry run on the CPU" in text
    for scenario in ("eth100: 2 nodes x 4 GPUs", "custom: 2 nodes x 4 GPUs, NIC 25 GB/s"):
        table = text.split(f"#### tiny, {scenario}")[1].split("####")[0]
        rows = [line.split(" | ")[0].lstrip("| ") for line in table.splitlines() if line.startswith("| ")][1:]
        assert rows == [
            "plain (no strategy)",
            "plain, again after every row",
            "DDP, overlapped",
            "DDP, not overlapped",
            "DDP, two-level all-reduce, overlapped",
            "baseline",
            "sdp4bit",
            "Trainer + sdp4bit",
        ]
        assert "nan" not in table and "inf" not in table
        assert "Trainer + sdp4bit: 1.0 Lightning collectives per step" in table  # the SIGTERM broadcast
    assert out.read_text() == text


def test_checkpointed_blocks_recompute_with_the_same_names_and_gradients():
    from gpt_step import build_gpt, lm_loss, random_tokens

    plain, checkpointed = (build_gpt(2, 4, 64, 32, CPU, 512, checkpoint_blocks=c) for c in (False, True))
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in checkpointed.named_parameters()]
    calls, tokens = [], random_tokens(2, 32, CPU, 512)
    for model in (plain, checkpointed):
        model.blocks[1].mlp.fc.register_forward_pre_hook(lambda module, args, model=model: calls.append(model))
        lm_loss(model, tokens).backward()
    assert (calls.count(plain), calls.count(checkpointed)) == (1, 2)  # forward, and again in the backward
    for a, b in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


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
    GPU for its bytes), behind matmuls on the compute stream: with the intra-node stage and the
    copy into rank order queued on the exchange stream, the weights equal the host-driven ones."""
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
