"""The emulated network's per-message latency (benchmarks/emulation.py), on the CPU.

Checks:
- `message_steps` counts the steps of each algorithm on each link as NCCL's cost model does:
  ring all-gather / reduce-scatter G - 1 steps (M - 1 across nodes), all-to-all one message per
  peer (those on other nodes across the NIC), all-reduce a ring or a tree, and refuses a group
  that does not spread evenly on its nodes or a collective it does not know;
- every collective on a lane is charged its bytes / bandwidth plus the latency of its cheapest
  algorithm on the links its group spans (NVLink inside a node, the NIC across nodes), and the
  latency part is reported on its own;
- the compute-only phase (infinite bandwidth) waits no latency, and latency 0 adds nothing;
- emulated_network.py: --latency-us and a list of --bucket-numel sizes are parsed (refused by name
  in test_emulated_network.py); a dry run with two bucket sizes prints each engine row once
  per size, the scenario's latency in its title, the latency part of each row's busy time (more
  buckets, more messages, more latency), and the DDP rows' latency for their 25 MiB buckets.
"""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lightning_sdp4bit.comm as comm
from lightning_sdp4bit.topology import Topology

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCHMARKS))

from emulation import Network, message_steps  # noqa: E402

CPU = torch.device("cpu")
US = 1000.0  # ns


@pytest.mark.parametrize(
    "kind, ranks, nodes, expected",
    [
        ("all_gather", 64, 16, [(48, 15)]),  # the world of 16 x 4
        ("reduce_scatter", 16, 16, [(0, 15)]),  # an inter-node group: one rank per node
        ("all_gather", 4, 1, [(3, 0)]),  # an intra-node group
        ("all_to_all", 64, 16, [(3, 60)]),
        ("all_to_all", 8, 8, [(0, 7)]),
        ("broadcast", 8, 2, [(6, 1)]),
        ("all_reduce", 64, 16, [(96, 30), (6, 8)]),  # ring, tree
        ("barrier", 8, 1, [(14, 0), (14, 0)]),
    ],
)
def test_message_steps_follow_nccls_cost_model(kind, ranks, nodes, expected):
    assert message_steps(kind, ranks, nodes) == expected


def test_message_steps_refuse_what_they_cannot_count():
    with pytest.raises(ValueError, match="6 ranks cannot spread evenly on 4 nodes"):
        message_steps("all_gather", 6, 4)
    with pytest.raises(ValueError, match="kind 'gather'"):
        message_steps("gather", 8, 2)


def _network(nvlink_us: float, nic_us: float, world: int = 8, ranks_per_node: int = 4) -> Network:
    network = Network(CPU, Topology(0, world, ranks_per_node), "own")
    network.set_rates(1.0, 1.0, nvlink_us, nic_us)  # 1 GB/s = 1 byte per ns
    return network


def test_each_collective_pays_its_groups_latency_on_the_links_it_crosses():
    network = _network(nvlink_us=2.0, nic_us=10.0)  # 2 nodes x 4
    groups = network.groups()
    x = torch.ones(64)
    with network.install():
        comm.all_gather(torch.empty(2 * 64), x, group=groups.inter)  # 1 NIC step
        comm.all_to_all(torch.empty(4 * 16), torch.ones(4 * 16), group=groups.intra)  # 3 NVLink messages
        comm.all_reduce(torch.ones(16), group=groups.world)  # tree: 6 NVLink + 2 NIC steps < ring 12 + 2
        dist.broadcast(torch.ones(8), src=0)  # Lightning's, its own lane: a chain of 6 NVLink + 1 NIC steps
    assert network.inter.busy_ns == pytest.approx(64 * 4 + 10 * US)
    assert network.intra.busy_ns == pytest.approx(3 / 4 * 64 * 4 + 3 * 2 * US)
    assert network.world.busy_ns == pytest.approx(2 * 7 / 8 * 64 + 6 * 2 * US + 2 * 10 * US)
    assert network.lightning.busy_ns == pytest.approx(32 + 6 * 2 * US + 10 * US)
    busy = network.link_busy_ns()
    assert busy["latency"] == pytest.approx((10 + 6 + 32 + 22) * US)
    assert busy["nic"] == pytest.approx(network.inter.busy_ns + network.world.busy_ns + network.lightning.busy_ns)


def test_a_ring_is_charged_when_it_is_cheaper_than_the_tree():
    # One node of 8: the tree has no NIC steps to save and 2 x 7 NVLink steps, as many as the ring.
    network = _network(nvlink_us=1.0, nic_us=100.0, world=8, ranks_per_node=8)
    with network.install():
        comm.all_reduce(torch.ones(4), group=network.groups().world)
    assert network.world.latency_ns == pytest.approx(14 * US)


@pytest.mark.parametrize("rates", [(math.inf, math.inf, 2.0, 10.0), (1.0, 1.0, 0.0, 0.0)])
def test_no_latency_without_a_network_or_with_latency_zero(rates):
    network = Network(CPU, Topology(0, 8, 4), "shared")
    network.set_rates(*rates)
    groups = network.groups()
    with network.install():
        comm.all_gather(torch.empty(2 * 10), torch.ones(10), group=groups.inter)
        comm.all_reduce(torch.ones(10), group=groups.world)
    assert network.link_busy_ns()["latency"] == 0.0
    expected = 0.0 if math.isinf(rates[0]) else 10 * 4 + 2 * 7 / 8 * 40
    assert network.inter.busy_ns + network.world.busy_ns == pytest.approx(expected)


def test_latency_and_bucket_sizes_parse():
    import emulated_network

    args = emulated_network.parse_args(["--dry-run", "--latency-us", "off", "--bucket-numel", "4e6,16000000"])
    assert args.latency_us == (0.0, 0.0) and args.bucket_numels == [4_000_000, 16_000_000]
    args = emulated_network.parse_args(["--dry-run"])
    assert args.latency_us is None and args.bucket_numels == [None]


def _rows(text: str, title: str) -> dict[str, list[str]]:
    table = text.split(f"#### {title}")[1].split("####")[0]
    cells = [[c.strip() for c in line.strip("| ").split(" | ")] for line in table.splitlines() if line.startswith("| ")]
    header, body = cells[0], cells[1:]
    return {row[0]: dict(zip(header[1:], row[1:], strict=True)) for row in body}


def test_a_dry_run_sweeps_bucket_sizes_with_latency():
    command = [
        sys.executable, str(BENCHMARKS / "emulated_network.py"), "--dry-run",
        "--trainer-presets", "none", "--scenarios", "eth100", "--bucket-numel", "2e3,2e5", "--latency-us", "2,10",
        "--presets", "baseline,sdp4bit",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    title = "tiny, eth100: 2 nodes x 4 GPUs, NIC 3.125 GB/s per GPU (25 Gb/s), NVLink 150 GB/s; latency per message"
    assert f"{title} step 2 us over NVLink, 10 us across nodes" in result.stdout
    rows = _rows(result.stdout, title)
    assert list(rows) == [
        "plain (no strategy)",
        "DDP, overlapped",
        "DDP, not overlapped",
        "DDP, two-level all-reduce, overlapped",
        "DDP, two-level all-reduce, in its order",
        "baseline, buckets of 0.002M",
        "baseline, buckets of 0.2M",
        "sdp4bit, buckets of 0.002M",
        "sdp4bit, buckets of 0.2M",
    ]
    for size in ("0.002M", "0.2M"):  # each row against the baseline of its own bucket size
        baseline, sdp4bit = rows[f"baseline, buckets of {size}"], rows[f"sdp4bit, buckets of {size}"]
        # Steps are printed to 0.1 ms and the ratio to 0.01: the ratio of the true steps lies
        # between these bounds of the printed ones (a few ms each here, so rounding is wide).
        b, s = float(baseline["step (ms)"]), float(sdp4bit["step (ms)"])
        low, high = (b - 0.05) / (s + 0.05), (b + 0.05) / (s - 0.05)
        assert low - 0.005 <= float(sdp4bit["x baseline"]) <= high + 0.005
    latency = "of which latency (ms)"
    small, large = float(rows["sdp4bit, buckets of 0.002M"][latency]), float(rows["sdp4bit, buckets of 0.2M"][latency])
    assert small > large > 0  # the tiny GPT (~0.1M parameters) in one bucket, or in dozens
    assert float(rows["plain (no strategy)"][latency]) == 0.0
    # DDP: one 25 MiB bucket; a flat all-reduce over 8 ranks on 2 nodes takes the tree (6 NVLink + 2 NIC
    # steps = 32 us), the two-level one 6 NVLink steps inside the node and 2 NIC steps across (32 us too).
    assert float(rows["DDP, overlapped"][latency]) == pytest.approx(0.03, abs=0.005)
    assert float(rows["DDP, two-level all-reduce, overlapped"][latency]) == pytest.approx(0.03, abs=0.005)
