"""Prefetching node-sharded gathers in the order the last pass of the same kind needed buckets
(`lightning_sdp4bit.gather_order`):
- a plan is the order of a pass's first needs; the buckets to prefetch are the next ones after the
  furthest place the pass has reached, so a bucket needed again later in the pass (for its
  gradients, after the recomputed forward) does not bring back buckets already done with; without
  a plan for that kind of pass, or for a bucket the plan does not hold, there is none (the guess
  by index applies); what is gathered between a backward and the next forward (a callback's
  reads) is no forward's plan;
- on a model whose blocks (five buckets each) recompute their forward in the backward, from the
  second step on only the first bucket of each pass is gathered without a prefetch (guessed by
  index, the recomputed forward's first buckets waited in every block), and no more buckets are
  gathered or in flight at once than with the guess.
"""

import pytest
import torch
from emulated import emulated_engine
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_sdp4bit.gather_order import GatherOrder
from lightning_sdp4bit.node_shards import NodeShards


def test_the_plan_is_the_last_pass_of_its_kind_and_prefetch_follows_the_furthest_place_reached():
    order = GatherOrder()
    order.forward_starts()
    for index in (4, 3, 2, 1, 0):
        order.needed([index], backward=False)
        assert order.after([index], backward=False, count=2) is None  # no forward seen yet
    order.forward_done()
    for index in (0, 2, 1, 0, 1, 2, 3):  # a backward: 2 and 1 recomputed, then their gradients
        order.needed([index], backward=True)
    order.forward_starts()
    order.needed([9], backward=False)  # a callback's read between the passes: no plan of a forward
    order.forward_starts()
    assert order.after([4], backward=False, count=2) == [3, 2]
    assert order.after([0], backward=False, count=2) == []
    assert order.after([7], backward=False, count=2) is None  # not in the plan: guess by index
    order.forward_done()  # the backward recorded above becomes the plan: 0, 2, 1, 3
    assert order.after([0], backward=True, count=2) == [2, 1]
    assert order.after([1], backward=True, count=1) == [3]
    assert order.after([2], backward=True, count=2) == [3]  # needed again: 1 is done with, not brought back


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return x + h


class _Recomputed(nn.Module):
    def __init__(self, blocks: int = 4, width: int = 32):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x


@pytest.mark.parametrize("ahead", [1, 2])
def test_after_the_first_step_only_each_passs_first_gather_waits_unprefetched(ahead, benchmark_script, monkeypatch):
    torch.manual_seed(0)
    model = _Recomputed()
    unprefetched, most_held = [], []
    land = NodeShards._land

    def watched_land(self, index):
        unprefetched[-1] += index not in self._landing
        most_held[-1] = max(most_held[-1], sum(self.gathered) + len(self._landing))
        return land(self, index)

    monkeypatch.setattr(NodeShards, "_land", watched_land)
    config = {"bucket_numel": 32 * 32 + 32, "weight_sharding": "node", "node_gather_prefetch": ahead}
    with emulated_engine(benchmark_script, model, **config) as engine:
        assert len(engine.buckets) == 20  # a Linear a bucket
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine.shard_optimizer(optimizer)
        for _ in range(3):
            engine.zero_grad()
            unprefetched.append(0)
            most_held.append(0)
            engine.pre_forward()
            loss = model(torch.randn(2, 32, requires_grad=True)).square().mean()
            engine.post_forward()
            unprefetched.append(0)
            most_held.append(0)
            engine.pre_backward()
            loss.backward()
            engine.post_backward()
            engine.clip_grad_norm(1.0)
            engine.pre_optimizer_step()
            optimizer.step()
            engine.post_optimizer_step()
        unprefetched.append(0)  # closing the engine gathers every bucket, unprefetched
        most_held.append(0)
    assert unprefetched[1] >= 2 * 4  # the first backward, guessed by index: recomputed forwards waited
    assert unprefetched[2:6] == [1, 1] * 2  # forward, backward, forward, backward
    assert max(most_held[2:6]) <= max(most_held[:2])
