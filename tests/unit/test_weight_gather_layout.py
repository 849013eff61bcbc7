"""Where the two-level weight all-gathers leave the gathered rows, on simulated process groups (one
process; the gloo processes of test_compression_collectives.py check the same gathers against the
simulation of the math), on 2 nodes x 4, 4 x 2 and 3 x 2:
- the quantized gathers (qWD and qW, stochastic rounding) make no transposed copy: the intra-node
  all-gather lands the rows local-major in the buffer the dequantization reads, which is told
  the node count; every rank's weights equal, bit for bit, those of the flat gather over the same
  ranks (rows in rank order, nodes = 1);
- the uncompressed gather still copies the rows into rank order, once per rank: its rows are
  the weights, which then hold every rank's master shard in rank order;
- every gather (qWD, qW, plain), in two levels and flat, leaves each rank's applied shard equal
  to its new weight shard bit for bit: the quantized ones through the apply (told this rank's
  applied shard and rank), the plain one by gathering from it.
"""

from unittest import mock

import pytest
import torch
from torch import nn

from lightning_sdp4bit import ops, weight_collectives
from lightning_sdp4bit.buffers import allocate_buckets, as_words, plan_buckets
from lightning_sdp4bit.config import SDP4BitConfig
from lightning_sdp4bit.simulation.engine import _simulated_groups
from lightning_sdp4bit.stats import WireMeter
from lightning_sdp4bit.topology import Topology
from lightning_sdp4bit.weight_collectives import PlainWeightAllGather, QuantizedWeightAllGather

SHARD = 512  # elements per rank: two groups of 256
CONFIG = SDP4BitConfig(weight_bits=4, weight_group_size=256, rounding="stochastic")


def _buckets(world):
    """Every rank's own bucket: the same bf16 weights, and rank r's master shard their slice r
    moved by a little noise of its own."""
    weights = torch.randn(world * SHARD, generator=torch.Generator().manual_seed(0)).bfloat16()
    buckets = []
    for rank in range(world):
        param = nn.Parameter(weights.clone())
        (layout,) = plan_buckets([("p", (world * SHARD,), torch.bfloat16)], world, 10**9, 256)
        (bucket,) = allocate_buckets([layout], {"p": param}, rank)
        noise = torch.randn(SHARD, generator=torch.Generator().manual_seed(rank + 1))
        bucket.master.copy_(bucket.weight_shard.float() + 0.01 * noise)
        buckets.append(bucket)
    return buckets


def _gather(kind, nodes, local):
    """Run the `kind` weight all-gather ("qWD", "qW" or "plain") on every rank of nodes x local
    (one node: flat), as the simulated engine drives it: start on every rank, then progress on
    every rank, then wait. Returns every rank's bucket, the number of copies into rank order
    (`as_words` calls) and the node counts the dequantization was told."""
    world = nodes * local
    buckets, told = _buckets(world), []
    apply = ops.weight_update_apply

    def spying(payload, weights, bits, group_size, additive, nodes=1, applied=None, rank=0):
        told.append(nodes)
        assert any(applied is b.applied_shard and rank == b.rank for b in buckets)
        return apply(payload, weights, bits, group_size, additive, nodes, applied, rank)

    with (
        mock.patch.object(weight_collectives, "as_words", wraps=as_words) as copies,
        mock.patch.object(ops, "weight_update_apply", spying),
    ):
        pending = []
        for rank, (groups, bucket) in enumerate(zip(_simulated_groups(nodes, local), buckets, strict=True)):
            topology = Topology(rank, world, local)
            if kind == "plain":
                collective = PlainWeightAllGather(topology, groups, WireMeter())
            else:
                collective = QuantizedWeightAllGather(CONFIG, topology, groups, WireMeter(), kind == "qWD")
            pending.append(collective.start(bucket, step=3))
        for exchange in pending:
            exchange.progress()
        for exchange in pending:
            exchange.wait()
    return buckets, copies.call_count, told


SHAPES = [pytest.param(nodes, local, id=f"{nodes} nodes x {local}") for nodes, local in ((2, 4), (4, 2), (3, 2))]


@pytest.mark.parametrize("nodes, local", SHAPES)
@pytest.mark.parametrize("kind", ["qWD", "qW"])
def test_the_quantized_gather_dequantizes_the_rows_where_they_land_with_the_flat_gathers_bits(kind, nodes, local):
    world = nodes * local
    buckets, copies, told = _gather(kind, nodes, local)
    flat, flat_copies, flat_told = _gather(kind, 1, world)
    assert copies == flat_copies == 0
    assert told == [nodes] * world and flat_told == [1] * world
    for rank in range(world):
        assert torch.equal(buckets[rank].weights.view(torch.int16), flat[rank].weights.view(torch.int16)), rank
    assert not torch.equal(flat[0].weights, _buckets(world)[0].weights)  # the gather changed them


@pytest.mark.parametrize("nodes, local", SHAPES)
def test_the_plain_gather_still_puts_the_rows_into_rank_order(nodes, local):
    world = nodes * local
    buckets, copies, _ = _gather("plain", nodes, local)
    assert copies == world  # one copy per rank
    expected = torch.cat([bucket.master for bucket in _buckets(world)]).bfloat16()
    for rank in range(world):
        assert torch.equal(buckets[rank].weights.view(torch.int16), expected.view(torch.int16)), rank


@pytest.mark.parametrize("nodes, local", [*SHAPES, pytest.param(1, 6, id="flat, 1 node x 6")])
@pytest.mark.parametrize("kind", ["qWD", "qW", "plain"])
def test_every_gather_leaves_the_applied_shard_equal_to_the_new_weight_shard(kind, nodes, local):
    buckets, _, _ = _gather(kind, nodes, local)
    before = _buckets(nodes * local)
    for rank, bucket in enumerate(buckets):
        assert torch.equal(bucket.applied_shard.view(torch.int16), bucket.weight_shard.view(torch.int16)), rank
        assert not torch.equal(bucket.applied_shard, before[rank].applied_shard), rank  # it was written
