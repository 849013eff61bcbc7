"""benchmarks/emulated_network.py and its emulation (benchmarks/emulation.py), on the CPU:
- loopback collectives write rank 0's share of the result and are charged the ring's bytes per
  rank for their group's size, on their group's lane and link, by purpose;
- the fake process groups take the shapes of the real ones; an unknown group goes to the world
  lane; Lightning's torch.distributed calls take the world lane or their own, and are counted;
  Network.install restores everything;
- bad arguments stop the script with a message that names the flag;
- the dry run (tiny GPT) prints a table per scenario with every row, where the step goes (the
  turn marked by the benchmark's own hooks) and the host for every row but the DDP estimates (the
  Trainer's too), Lightning's per-batch
  broadcast on the emulated world link, and the same text to --markdown (no timing asserted);
- repeats: each round runs every job once, rotated, odd rounds backwards; each row shows the
  median of its runs and their min-max; --tables-from prints the same text from --json;
- fresh state: a run whose engine outlives it raises, naming the row;
- a job of 64 ranks, as 16 nodes x 4 and as 8 nodes x 8 (ib400), runs;
- activation checkpointing: names and gradients unchanged, each block runs forward twice, the
  engine trains a checkpointed GPT to the same weights bit for bit; its dry run runs;
- the host table names a slow step, the host's lead, the collector's passes and the allocator's
  calls.
"""

import json
import os
import re
import statistics
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lightning_sdp4bit.comm as comm
from lightning_sdp4bit.config import SDP4BitConfig
from lightning_sdp4bit.topology import Topology

BENCHMARKS = Path(__file__).resolve().parents[1]
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
    # By purpose: all-gathers carry weights, reduce-scatters and all-to-alls gradients.
    assert links["nic_weights"] == 7 / 8 * gathered.nbytes
    assert links["nic_gradients"] == 7 / 8 * gathered.nbytes + 1 / 2 * 12
    assert links["nic_other"] == 2 * 7 / 8 * 8 + 8
    assert (links["nvlink_gradients"], links["nvlink_weights"], links["nvlink_other"]) == (3 / 4 * 12, 0.0, 0.0)


def test_the_all_gather_loopback_repeats_a_payload_whatever_words_its_rows_allow():
    network = _network()
    groups = network.groups()
    whole = torch.arange(2, 26, dtype=torch.uint8)
    # 24 bytes (three 8-byte words), 12 (three 4-byte words), 11 at an odd offset (bytes)
    with network.install():
        for row in (whole, whole[:12], whole[1:12]):
            rows = torch.empty(4 * row.numel(), dtype=torch.uint8)
            comm.all_gather(rows, row, group=groups.intra)
            assert torch.equal(rows, row.repeat(4))


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
    # The script's Trainer rows rendezvous on a free port of their own. An in-process fit of an
    # earlier test leaves MASTER_PORT in this process's environment, with its store still
    # listening there: inherited, it would make them collide with it (EADDRINUSE).
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--world", "6"], "--ranks-per-node=4 must divide --world=6"),
        (["--scenarios", "custom"], "the custom scenario needs --link-gbps"),
        (["--presets", "sdp4bit,fast"], "--presets: fast not among"),
        (["--model", "356m"], "--dry-run runs a tiny model on the CPU: tiny or tiny-ckpt, not 356m"),
        (["--repeats", "0"], "--steps and --repeats must be >= 1"),
        (["--latency-us", "3"], "--latency-us: '3' is not NVLINK,NIC microseconds"),
        (["--latency-us", "2,-1"], "latencies must be >= 0 microseconds"),
        (["--bucket-numel", "4e6,big"], "--bucket-numel: '4e6,big' is not a comma list"),
        (["--bucket-numel", "0.5"], "every size must be a whole number of elements >= 1"),
        (["--profile-python"], "--profile-python and --profile-kernels choose what the trace records: they need"),
        (["--profile-kernels"], "--profile-python and --profile-kernels choose what the trace records: they need"),
        (["--profile", "t.json", "--profile-python", "--profile-kernels"], "the host's calls, --profile-kernels none"),
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
            "DDP, overlapped",
            "DDP, not overlapped",
            "DDP, two-level all-reduce, overlapped",
            "DDP, two-level all-reduce, in its order",
            "baseline",
            "sdp4bit",
            "Trainer + sdp4bit",
        ]
        assert "nan" not in table and "inf" not in table
        assert "Trainer + sdp4bit: 1.0 Lightning collectives per step" in table  # the SIGTERM broadcast
        # Where the step goes: every row marks its segments (a Trainer row from its strategy's
        # pre_backward and post_backward, where engine_step marks them).
        segments = _table_rows(text, f"tiny, {scenario.split(':')[0]}: where the step goes")
        assert list(segments) == ["plain (no strategy)", "baseline", "sdp4bit", "Trainer + sdp4bit"]
        assert all(len(cells) == 11 and "nan" not in cells for cells in segments.values())
        assert segments["plain (no strategy)"][7] == "0.0%" and segments["sdp4bit"][7] != "0.0%"  # the end bucket
        assert segments["plain (no strategy)"][6] == "-" and len(segments["sdp4bit"][6].split(" / ")) == 3
        # The turn, from the compute-only phase: within the forward and the backward it bounds.
        assert segments["plain (no strategy)"][8] == "-"
        assert segments["Trainer + sdp4bit"][7] == segments["sdp4bit"][7]  # the same engine's end bucket
        for row in ("baseline", "sdp4bit", "Trainer + sdp4bit"):
            tail, head = map(float, segments[row][8].split(" / "))
            forward, backward, _ = map(float, segments[row][3].split(" / "))
            assert 0 < tail <= forward + 0.1 and 0 < head <= backward + 0.1
        assert "the engine on the compute stream" not in text  # read from a profile's labels instead
        # The host: each row's slowest step against its median; on the CPU no lead (one clock).
        host = _table_rows(text, f"tiny, {scenario.split(':')[0]}: the host")
        assert list(host) == ["plain (no strategy)", "baseline", "sdp4bit", "Trainer + sdp4bit"]
        assert host["plain (no strategy)"][0].startswith("- / ") and host["sdp4bit"][1:3] == ["-", "-"]
        assert host["Trainer + sdp4bit"][1:3] == ["-", "-"] and host["sdp4bit"][4] == "-; -"  # no allocator
        assert all(float(ratio) >= 1.0 for cells in host.values() for ratio in cells[0].split(" / ") if ratio != "-")
    assert out.read_text() == text


def _table_rows(text: str, title: str) -> dict[str, list[str]]:
    """Row name -> its cells, of the table under `#### title`."""
    table = text.split(f"#### {title}")[1].split("####")[0]
    cells = [[c.strip() for c in line.strip("| ").split(" | ")] for line in table.splitlines() if line.startswith("| ")]
    return {row[0]: row[1:] for row in cells[1:]}


@pytest.mark.parametrize("count", [2, 3, 8])
def test_interleave_runs_odd_rounds_backwards_and_rotates_every_second_round(count):
    import emulated_network

    jobs = [f"job{i}" for i in range(count)]
    assert emulated_network.interleave(jobs, 1) == [jobs]
    rounds = emulated_network.interleave(jobs, 4)
    assert rounds[0] == jobs
    assert rounds[1] == jobs[::-1]
    assert rounds[2] == jobs[1:] + jobs[:1]
    assert all(sorted(order) == sorted(jobs) for order in rounds)  # every job once a round
    assert len({order[0] for order in rounds[:3]}) == min(3, count)  # no job always first
    assert [order.index(jobs[0]) for order in rounds] == [0, count - 1, count - 1, count - 2]  # two jobs: AB BA BA AB
    sequence = [job for order in rounds[:3] for job in order]
    for job in jobs if count > 2 else []:  # two jobs have one neighbour each
        before = {sequence[i - 1] for i, other in enumerate(sequence) if other == job and i > 0}
        assert len(before) >= 2, f"{job} always runs after {before}"


def test_fresh_state_raises_when_an_engine_outlives_its_run():
    from emulated_runs import fresh_state

    from lightning_sdp4bit.engine import ShardedEngine

    topology = Topology(0, 8, 4)
    network, kept = Network(CPU, topology, "own"), []
    for keep in (False, True):
        with network.install():
            model = torch.nn.Linear(64, 64)
            engine = ShardedEngine(model, SDP4BitConfig.preset("sdp4bit", ranks_per_node=4), topology, network.groups())
            engine.close()
        if keep:
            kept.append(engine)  # as a leaked reference would: a global, a cycle through a hook, ...
        ref = weakref.ref(engine)
        del model, engine
        if not keep:
            with fresh_state("tiny: sdp4bit", CPU) as watched:
                watched.append(ref)
            assert ref() is None
        else:
            with pytest.raises(RuntimeError, match="tiny: sdp4bit: its ShardedEngine outlived the run"):
                with fresh_state("tiny: sdp4bit", CPU) as watched:
                    watched.append(ref)


def test_dry_run_with_repeats_prints_the_median_and_min_max_of_the_runs(tmp_path, capsys):
    out = tmp_path / "runs.json"
    presets = ["--presets", "baseline,sdp4bit", "--trainer-presets", "none", "--scenarios", "ib400"]
    result = _script("--dry-run", "--repeats", "2", *presets, "--json", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| row | step (ms) | min-max (ms) | spread |" in result.stdout
    rows = _table_rows(result.stdout, "tiny, ib400")
    runs = json.loads(out.read_text())["runs"]
    assert [(r["round"], r["row"]) for r in runs] == [
        (0, "plain"), (0, "baseline"), (0, "sdp4bit"), (1, "sdp4bit"), (1, "baseline"), (1, "plain"),
    ]  # fmt: skip
    for row in ("plain", "baseline", "sdp4bit"):
        steps = [r["step_ms"] if row == "plain" else r["ib400"]["step_ms"] for r in runs if r["row"] == row]
        cells = rows["plain (no strategy)" if row == "plain" else row]
        assert cells[0] == f"{statistics.median(steps):.1f}"
        assert cells[1] == f"{min(steps):.1f}-{max(steps):.1f}"
        assert re.fullmatch(r"\d+\.\d%", cells[2])
    assert "Each row: the median of 2 runs interleaved with the other rows'" in result.stdout
    import emulated_network

    emulated_network.main(["--tables-from", str(out)])  # the same text again, from the raw runs alone
    assert capsys.readouterr().out == result.stdout


@pytest.mark.parametrize(
    "ranks_per_node, scenarios, title",
    [
        ("4", "ib400,eth100", "tiny, eth100: 16 nodes x 4 GPUs, NIC 3.125 GB/s"),
        ("8", "ib400", "tiny, ib400: 8 nodes x 8 GPUs, NIC 50 GB/s per GPU (400 Gb/s)"),
    ],
)
def test_dry_run_of_64_ranks(ranks_per_node, scenarios, title):
    presets = ["--presets", "baseline,sdp4bit", "--trainer-presets", "sdp4bit"]
    result = _script(
        "--dry-run", "--world", "64", "--ranks-per-node", ranks_per_node, "--scenarios", scenarios, *presets
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0 of 64 ranks" in result.stdout
    assert list(_table_rows(result.stdout, title))[-3:] == ["baseline", "sdp4bit", "Trainer + sdp4bit"]


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


def test_the_engine_trains_a_checkpointed_gpt_to_the_same_weights():
    from emulated_runs import MODELS
    from gpt_step import engine_step, make_optimizer

    from lightning_sdp4bit.engine import ShardedEngine

    topology = Topology(0, 8, 4)
    weights, waits = {}, {}
    for name in ("tiny", "tiny-ckpt"):
        network, spec = Network(CPU, topology, "own"), MODELS[name]
        with network.install():
            model = spec.build(CPU)
            engine = ShardedEngine(model, SDP4BitConfig.preset("sdp4bit", ranks_per_node=4), topology, network.groups())
            optimizer = make_optimizer(model.parameters(), CPU)
            engine.shard_optimizer(optimizer)
            tokens = spec.tokens(CPU)
            wait, waits[name] = engine.wait_weights, []
            engine.wait_weights = lambda indices=None, wait=wait, name=name: (
                waits[name].append(indices) or wait(indices)
            )
            for _ in range(3):
                engine_step(model, engine, optimizer, tokens)
            engine.close()
            weights[name] = [p.detach().clone() for p in model.parameters()]
    assert len(waits["tiny-ckpt"]) > len(waits["tiny"])  # the blocks' hooks fire again in the backward
    initial = list(MODELS["tiny"].build(CPU).parameters())
    assert not all(torch.equal(a, b) for a, b in zip(initial, weights["tiny"], strict=True))  # it trained
    for a, b in zip(weights["tiny"], weights["tiny-ckpt"], strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_dry_run_of_a_checkpointed_gpt():
    presets = ["--presets", "sdp4bit", "--trainer-presets", "sdp4bit", "--scenarios", "ib400"]
    result = _script("--dry-run", "--model", "tiny-ckpt", *presets)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bf16 GPT (tiny-ckpt with activation checkpointing)" in result.stdout
    assert list(_table_rows(result.stdout, "tiny-ckpt, ib400"))[-2:] == ["sdp4bit", "Trainer + sdp4bit"]


def test_the_host_table_names_a_slow_step_the_hosts_lead_the_collectors_passes_and_the_allocators_calls():
    from emulated_tables import host_table
    from phase_timer import Phase

    def phase(steps, lead, full, frees=None):
        passes = [1.0, 0.0, full]  # per timed step, by generation
        allocator = {} if frees is None else {"cudaMalloc": 2.0 * frees, "cudaFree": frees}  # a torch without syncs
        return {
            "steps_ms": steps,
            "host_lead_ms": lead,
            "gc_passes": passes,
            "gc_ms": 20.0 * full,
            "allocator": allocator,
        }

    lead = {"forward": 3.0, "backward": 0.04, "optimizer": 1.5}
    plain = [phase([100.0, 104.0], lead, 0.0)]
    runs = {
        "sdp4bit": [
            {"compute": phase([100.0, 100.0], lead, 0.0, 0.0), "eth100": phase([120.0, 121.0], lead, 0.0, 0.0)},
            {"compute": phase([100.0, 130.0], lead, 0.5, 1.0), "eth100": phase([120.0, 122.0], lead, 0.0, 0.0)},
        ],
        "old": [{"compute": {"step_ms": 1.0}, "eth100": {"step_ms": 1.0}}],  # a --json file from before
    }
    rows = _table_rows(host_table("1.3b", Phase("eth100"), plain, runs), "1.3b, eth100: the host")
    assert rows == {
        "plain (no strategy)": ["- / 1.02", "-", "3.00 / 0.04 / 1.50", "-; 0.00 / 1.00 (0.0)", "-; -"],
        "sdp4bit": [
            "1.01 / 1.30",
            "3.00 / 0.04 / 1.50",
            "3.00 / 0.04 / 1.50",
            "0.00 / 1.00 (0.0); 0.25 / 1.25 (5.0)",
            "0.0 / 0.0 / -; 1.0 / 0.5 / -",  # the mean of the repeats
        ],
    }


def test_the_host_table_counts_the_runs_whose_host_fell_behind_the_gpu():
    from emulated_tables import host_table
    from phase_timer import Phase

    def phase(backward_lead):
        lead = {"forward": 5.0, "backward": backward_lead, "optimizer": 1.0}
        return {"steps_ms": [150.0], "host_lead_ms": lead, "gc_passes": [0.0, 0.0, 0.0], "gc_ms": 0.0, "allocator": {}}

    plain = [phase(105.0), phase(104.0)]
    runs = {
        "sdp4bit": [  # one network run and two compute-only runs within 10 ms of the GPU
            {"compute": phase(-0.02), "eth100": phase(45.0)},
            {"compute": phase(9.9), "eth100": phase(0.5)},
            {"compute": phase(10.0), "eth100": phase(47.0)},
        ],
        "baseline": [{"compute": phase(40.0), "eth100": phase(50.0)}],
    }
    table = host_table("1.3b", Phase("eth100"), plain, runs)
    assert "Runs bound by the host" not in host_table("1.3b", Phase("eth100"), plain, {"baseline": runs["baseline"]})
    note = next(line for line in table.splitlines() if line.startswith("Runs bound by the host"))
    assert note.endswith(": sdp4bit, network: 1 of 3; sdp4bit, compute-only: 2 of 3.")
