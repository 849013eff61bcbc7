"""The compressed collectives on real gloo processes, against the single-process simulations of
the reference module: the two-level reduce-scatter bit for bit (nearest and seeded stochastic
rounding) over a grid of bits x group size x Hadamard on/off, on 4 processes as 2 nodes x 2,
4 x 1 and 1 x 4, and on 3 processes as 3 odd nodes; the chunk layout gives the same contiguous
shard as the uncompressed reduce-scatter; the qWD, qW and plain all-gathers equal the simulation
on the same topologies, in two levels (one row per rank across nodes) where there are several
nodes of several ranks, where only the plain one copies the rows into rank order (the quantized
ones dequantize them where they land); and the paper's Counterexample 4.1 through the library's
weight all-gather."""

import contextlib
import itertools
import random
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
from distributed import run_workers
from torch import nn

from lightning_sdp4bit import SDP4BitConfig, comm, weight_collectives
from lightning_sdp4bit.buffers import allocate_buckets, as_words, plan_buckets
from lightning_sdp4bit.collectives import PlainGradReduceScatter, Stage, TwoLevelGradReduceScatter
from lightning_sdp4bit.reference.ops import payload_row_bytes, stage_seed
from lightning_sdp4bit.reference.simulate import simulate_two_level_reduce_scatter, simulate_weight_all_gather
from lightning_sdp4bit.stats import WireMeter
from lightning_sdp4bit.topology import Topology, create_process_groups
from lightning_sdp4bit.weight_collectives import PlainWeightAllGather, QuantizedWeightAllGather

GRID = list(itertools.product([(8, 4), (4, 4), (2, 8)], [32, 128], [0, 32]))  # (intra, inter bits), group, H


def make_bucket(world, rank, numel, dtype=torch.float32, alignment=128):
    param = nn.Parameter(torch.zeros(numel, dtype=dtype))
    (layout,) = plan_buckets([("p", (numel,), dtype)], world, 10**9, alignment)
    (bucket,) = allocate_buckets([layout], {"p": param}, rank)
    return bucket


def _grads(world, numel, seed):
    # Heavy-tailed, with an exact zero group and an outlier, to exercise the absmax scales.
    grads = []
    for rank in range(world):
        generator = torch.Generator().manual_seed(seed * 100 + rank)
        g = torch.randn(numel, generator=generator) * torch.rand(numel, generator=generator) ** 4
        g[:128] = 0.0
        g[200] = 50.0
        grads.append(g)
    return grads


def _two_level_grid(rank, world, ranks_per_node, grid):
    topology = Topology(rank, world, ranks_per_node)
    groups = create_process_groups(topology)
    mismatches = []
    for step, ((intra, inter), group, hadamard, rounding) in enumerate(grid):
        config = SDP4BitConfig(
            grad_intra_bits=intra,
            grad_inter_bits=inter,
            grad_group_size=group,
            hadamard_size=hadamard,
            rounding=rounding,
        )
        bucket = make_bucket(world, rank, 1000, alignment=group)
        grads = _grads(world, bucket.layout.numel, step)
        collective = TwoLevelGradReduceScatter(config, topology, groups, WireMeter(), rank)
        pending = collective.start(bucket, grads[rank].clone(), 1.0, step)
        pending.progress()
        pending.wait()
        expected = simulate_two_level_reduce_scatter(
            grads,
            ranks_per_node,
            intra_bits=intra,
            inter_bits=inter,
            group_size=group,
            hadamard_size=hadamard,
            rounding=rounding,
            seed_fn=lambda r, stage, step=step, base=config.seed: stage_seed(base, step, 0, r, stage),
        )[rank]
        if not torch.equal(bucket.grad_shard, expected):
            mismatches.append((intra, inter, group, hadamard, rounding))
        # The shard is the same contiguous slice as the uncompressed reduce-scatter's: of all
        # ranks' slices of the exact sum, it is closest to this rank's.
        exact = torch.stack(grads).sum(0).view(world, -1)
        errors = (exact - bucket.grad_shard).norm(dim=1)
        assert int(errors.argmin()) == rank
    return mismatches


TOPOLOGIES = [
    pytest.param(4, 2, id="2 nodes x 2"),
    pytest.param(4, 1, id="4 nodes x 1"),
    pytest.param(4, 4, id="1 node x 4"),
]


@pytest.mark.parametrize("world, ranks_per_node", TOPOLOGIES)
def test_two_level_reduce_scatter_equals_the_simulation_bit_for_bit(world, ranks_per_node):
    grid = [(*combo, "nearest") for combo in GRID] + [((8, 4), 128, 32, "stochastic")]
    for mismatches in run_workers(_two_level_grid, world, ranks_per_node, grid):
        assert mismatches == []


def test_two_level_on_an_odd_number_of_nodes():
    grid = [((8, 4), 128, 32, "nearest"), ((8, 4), 128, 32, "stochastic")]
    for mismatches in run_workers(_two_level_grid, 3, 1, grid):
        assert mismatches == []


@contextlib.contextmanager
def _bytes_by_group(collective: str, groups) -> Iterator[dict[str, int]]:
    """Count the input bytes of `comm.<collective>` per group ("intra", "inter" or "world"; a stage
    that spans the world is the world group itself, so that name wins) while the block runs."""
    names = {id(groups.intra): "intra", id(groups.inter): "inter", id(groups.world): "world"}
    sent: dict[str, int] = {}
    original = getattr(comm, collective)

    def counting(output, input, group=None, async_op=False):
        sent[names[id(group)]] = sent.get(names[id(group)], 0) + input.nbytes
        return original(output, input, group=group, async_op=async_op)

    setattr(comm, collective, counting)
    try:
        yield sent
    finally:
        setattr(comm, collective, original)


def _weight_all_gathers(rank, world, ranks_per_node):
    """qWD, qW and the plain all-gather on one topology: (name, equal to the simulation, master
    untouched, {group: input bytes} through a patched comm.all_gather, copies into rank order)."""
    topology = Topology(rank, world, ranks_per_node)
    groups = create_process_groups(topology)
    config = SDP4BitConfig(weight_bits=4, weight_group_size=256, rounding="nearest")
    results = []
    for name, additive in [("qWD", True), ("qW", False), ("plain", None)]:
        bucket = make_bucket(world, rank, 3000, dtype=torch.bfloat16, alignment=256)
        torch.manual_seed(0)  # same starting weights everywhere
        bucket.weights.copy_(torch.randn(bucket.layout.numel))
        before = bucket.weights.clone()
        shard = bucket.layout.shard_numel
        masters = [before[r * shard :][:shard].float() for r in range(world)]
        masters = [
            m + 0.01 * torch.randn(m.shape, generator=torch.Generator().manual_seed(r)) for r, m in enumerate(masters)
        ]
        bucket.master.copy_(masters[rank])
        if additive is None:
            collective = PlainWeightAllGather(topology, groups, WireMeter())
            expected = torch.cat(masters).to(torch.bfloat16)
        else:
            collective = QuantizedWeightAllGather(config, topology, groups, WireMeter(), additive)
            expected = simulate_weight_all_gather(
                masters, before, additive=additive, bits=4, group_size=256, rounding="nearest"
            )
        with (
            _bytes_by_group("all_gather", groups) as sent,
            mock.patch.object(weight_collectives, "as_words", wraps=as_words) as copies,
        ):
            pending = collective.start(bucket, step=0)
            pending.progress()
            pending.wait()
        equal, master_untouched = torch.equal(bucket.weights, expected), torch.equal(bucket.master, masters[rank])
        results.append((name, equal, master_untouched, dict(sent), copies.call_count))
    return results


def _plain_reduce_scatter(rank, world, ranks_per_node):
    """The uncompressed reduce-scatter on one topology: (shard, {group: input bytes})."""
    topology = Topology(rank, world, ranks_per_node)
    groups = create_process_groups(topology)
    bucket = make_bucket(world, rank, 3000, dtype=torch.bfloat16)
    grads = [g.bfloat16() for g in _grads(world, bucket.layout.numel, 7)]
    with _bytes_by_group("reduce_scatter", groups) as sent:
        pending = PlainGradReduceScatter(topology, groups, WireMeter()).start(bucket, grads[rank], 1 / world, 0)
        pending.progress()
        pending.wait()
    return bucket.grad_shard.clone(), sent


def _exchanges(rank, world, ranks_per_node):
    return {
        "weights": _weight_all_gathers(rank, world, ranks_per_node),
        "reduce_scatter": _plain_reduce_scatter(rank, world, ranks_per_node),
    }


@pytest.fixture(scope="module", params=[pytest.param(t.values, id=t.id) for t in TOPOLOGIES])
def exchanges(request):
    """(world, ranks_per_node, each rank's results): one set of processes per topology."""
    world, ranks_per_node = request.param
    return world, ranks_per_node, run_workers(_exchanges, world, ranks_per_node)


def test_weight_all_gathers_equal_the_simulation_and_cross_nodes_once(exchanges):
    """Bit for bit on every topology. With 2 nodes x 2 the all-gather goes in two levels: this
    rank's own row once across nodes, then the node's two rows inside it, which only the plain
    gather copies into rank order (the quantized ones read them where they land); one node or one
    rank per node is one all-gather over the world, in rank order."""
    world, ranks_per_node, results = exchanges
    for result in results:
        for name, equal, master_untouched, sent, copies in result["weights"]:
            assert equal and master_untouched, name
            shard = 3072 // world  # 3000 elements padded to whole 256-groups per rank
            row = 2 * shard if name == "plain" else payload_row_bytes(shard, bits=4, group_size=256)
            if ranks_per_node in (1, world):
                assert sent == {"world": row} and copies == 0, name
            else:
                assert sent == {"inter": row, "intra": 2 * row}, name
                assert copies == (1 if name == "plain" else 0), name


def test_plain_reduce_scatter_gives_each_rank_its_shard_of_the_mean_and_crosses_nodes_once(exchanges):
    """Each rank's own contiguous shard of the mean, on every topology (to fp32 rounding: the
    two-level sums go in another order). With 2 nodes x 2 it goes inside the node first (the whole
    bucket in fp32) and then across nodes (this local index's [nodes, S])."""
    world, ranks_per_node, results = exchanges
    numel = 3072  # 3000 padded to whole 128-groups per rank
    grads = [g.bfloat16().float() for g in _grads(world, numel, 7)]
    mean = torch.stack(grads).sum(0).view(world, -1) / world
    for rank, result in enumerate(results):
        shard, sent = result["reduce_scatter"]
        torch.testing.assert_close(shard, mean[rank], rtol=1e-6, atol=1e-6)
        if ranks_per_node in (1, world):
            assert sent == {"world": 4 * numel}
        else:
            assert sent == {"intra": 4 * numel, "inter": 4 * numel // ranks_per_node}


def _counterexample(rank, world, additive, steps, lr):
    """f(w) = ||w||^2 from w = (1, -1); the stochastic gradient is (4 w1, 0) or (0, 4 w2) with
    probability 1/2 each; the weight compressor is nearest ternary with scale max|w| (2-bit codes,
    one group). qW quantizes the new iterate itself, w <- Q(w - lr g); qWD keeps an exact master
    m <- m - lr g and sends w <- w + Q(m - w). Rank 0 owns both coordinates; rank 1 owns padding."""
    topology = Topology(rank, world, world)
    groups = create_process_groups(topology)
    config = SDP4BitConfig(weight_bits=2, weight_group_size=32, rounding="nearest")
    bucket = make_bucket(world, rank, 2, alignment=32)
    bucket.weights[:2] = torch.tensor([1.0, -1.0])
    bucket.master.copy_(bucket.weight_shard)
    collective = QuantizedWeightAllGather(config, topology, groups, WireMeter(), additive)
    coin = random.Random(0)  # the same draws on both ranks
    for step in range(steps):
        w = bucket.weights[:2].clone()
        g = torch.tensor([4 * w[0], 0.0]) if coin.random() < 0.5 else torch.tensor([0.0, 4 * w[1]])
        if rank == 0:
            start = bucket.master[:2] if additive else w  # qW has no state beyond the iterate
            bucket.master[:2] = start - lr * g
        collective.start(bucket, step).wait()
    return bucket.weights[:2].tolist()


def test_counterexample_4_1_quantized_weights_stay_stuck_while_differences_converge():
    stuck = run_workers(_counterexample, 2, False, 200, 0.1)
    converged = run_workers(_counterexample, 2, True, 200, 0.1)
    assert stuck[0] == stuck[1] == [1.0, -1.0]
    assert converged[0] == converged[1] and max(abs(v) for v in converged[0]) < 1e-6


def test_stage_numbers_are_distinct():
    assert len({int(s) for s in Stage}) == len(Stage)
