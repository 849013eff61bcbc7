"""Where the two-level weight all-gathers leave the gathered rows, on simulated process groups (one
process; the gloo processes of test_compression_collectives.py check the same gathers against the
simulation of the math), on 2 nodes x 4, 4 x 2 and 3 x 2:
- the quantized gathers (qWD and qW, stochastic rounding) make no transposed copy: the intra-node
  all-gather lands the rows local-major in the buffer the dequantization reads, which is told
  the node count; every rank's weights equal, bit for bit, those of the flat gather over the same
  ranks (rows in rank order, nodes = 1);
- the uncompressed gather still copies the rows into rank order, once per rank: its rows are
  the weights, which then hold every rank's master shard in rank order.
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
    (`local` = nodes x local ranks: flat, one node), as the simulated engine drives it: start on
    every rank, then progress on every rank, then wait. Returns every rank's weights, the number
    of copies into rank order (`as_words` calls) and the node counts the dequantization was told."""
    world = nodes * local
    buckets, told = _buckets(world), []
    apply = ops.weight_update_apply

    def spying(payload, weights, bits, group_size, additive, nodes=1):
        told.append(nodes)
        return apply(payload, weights, bits, group_size, additive, nodes)

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
    return [bucket.weights for bucket in buckets], copies.call_count, told


SHAPES = [pytest.param(nodes, local, id=f"{nodes} nodes x {local}") for nodes, local in ((2, 4), (4, 2), (3, 2))]


@pytest.mark.parametrize("nodes, local", SHAPES)
@pytest.mark.parametrize("kind", ["qWD", "qW"])
def test_the_quantized_gather_dequantizes_the_rows_where_they_land_with_the_flat_gathers_bits(kind, nodes, local):
    world = nodes * local
    weights, copies, told = _gather(kind, nodes, local)
    flat, flat_copies, flat_told = _gather(kind, 1, world)
    assert copies == flat_copies == 0
    assert told == [nodes] * world and flat_told == [1] * world
    for rank in range(world):
        assert torch.equal(weights[rank].view(torch.int16), flat[rank].view(torch.int16)), rank
    assert not torch.equal(flat[0], _buckets(world)[0].weights)  # the gather changed them


@pytest.mark.parametrize("nodes, local", SHAPES)
def test_the_plain_gather_still_puts_the_rows_into_rank_order(nodes, local):
    world = nodes * local
    weights, copies, _ = _gather("plain", nodes, local)
    assert copies == world  # one copy per rank
    expected = torch.cat([bucket.master for bucket in _buckets(world)]).bfloat16()
    for rank in range(world):
        assert torch.equal(weights[rank].view(torch.int16), expected.view(torch.int16)), rank
