"""When weight_sharding="node" gathers and releases buckets, in one process (rank 0 of an emulated
2 nodes x 4 job, `emulated.emulated_engine`), on a model of three linear layers in three buckets:
- in forward a bucket is released once every module owning parameters in it has run forward, so
  at each module's forward only its own bucket is gathered, and none after the forward;
- the backward gathers each bucket again (a module's output hook) and releases it once its
  gradients are in: a step gathers the three buckets in forward and again in backward, and every
  bucket is released after it; the next step does the same;
- `node_gather_prefetch` = k starts the gathers of the next k buckets, in the order the forward
  reaches them, when a module's own bucket lands (0: each at its module's forward only);
- on a GPT-2-shaped model, the bucket of a head tied to the token embedding goes as soon as the
  head's backward is done, and an embedding's bucket is never gathered for the backward (an
  nn.Embedding's backward reads no weight): tied, the bucket is gathered twice a step (the
  forward, the head's backward), untied once;
- a tied parameter read between its modules' forwards, its bucket gathered, keeps the bucket
  until the end of the backward: no module's backward says when autograd is done with it.
"""

import pytest
import torch
from emulated import emulated_engine
from models import TiedGPT
from torch import nn

from lightning_sdp4bit.node_shards import NodeShards


def test_each_bucket_is_gathered_for_its_modules_forward_and_backward_and_released_after_each(
    benchmark_script, monkeypatch
):
    torch.manual_seed(0)
    layers = [nn.Linear(64, 64) for _ in range(3)]
    model = nn.Sequential(layers[0], nn.GELU(), layers[1], layers[2])
    started = []
    start = NodeShards._start
    monkeypatch.setattr(NodeShards, "_start", lambda self, index: (started.append(index), start(self, index))[1])
    with emulated_engine(benchmark_script, model, bucket_numel=64 * 64 + 64, weight_sharding="node") as engine:
        shards = engine.primary.node_shards
        bucket_of = {id(p): b.layout.index for b in engine.buckets for p in b.params}
        own = [bucket_of[id(layer.weight)] for layer in layers]
        assert sorted(own) == [0, 1, 2]
        seen_in_forward = []
        for layer in layers:  # after the engine's pre-hooks
            layer.register_forward_pre_hook(lambda m, a: seen_in_forward.append(shards.gathered.copy()))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine.shard_optimizer(optimizer)
        for _ in range(2):
            engine.zero_grad()
            started.clear()
            seen_in_forward.clear()
            engine.pre_forward()
            loss = model(torch.randn(4, 64)).square().mean()
            engine.post_forward()
            assert [[i for i, g in enumerate(gathered) if g] for gathered in seen_in_forward] == [[i] for i in own]
            assert not any(shards.gathered)
            assert sorted(started) == [0, 1, 2]
            engine.pre_backward()
            loss.backward()
            engine.post_backward()
            assert sorted(started) == [0, 0, 1, 1, 2, 2]
            assert not any(shards.gathered)
            engine.clip_grad_norm(1.0)
            engine.pre_optimizer_step()
            optimizer.step()
            engine.post_optimizer_step()


@pytest.mark.parametrize("ahead", [0, 1, 2])
def test_node_gather_prefetch_starts_that_many_gathers_ahead_of_the_forward(ahead, benchmark_script, monkeypatch):
    torch.manual_seed(0)
    layers = [nn.Linear(64, 64) for _ in range(3)]
    model = nn.Sequential(*layers)
    events = []
    start = NodeShards._start
    monkeypatch.setattr(NodeShards, "_start", lambda self, index: (events.append(index), start(self, index))[1])
    config = {"bucket_numel": 64 * 64 + 64, "weight_sharding": "node", "node_gather_prefetch": ahead}
    with emulated_engine(benchmark_script, model, **config) as engine:
        bucket_of = {id(p): b.layout.index for b in engine.buckets for p in b.params}
        own = [bucket_of[id(layer.weight)] for layer in layers]
        for number, layer in enumerate(layers):
            layer.register_forward_pre_hook(lambda m, a, number=number: events.append(f"forward {number}"))
        engine.pre_forward()
        with torch.no_grad():
            model(torch.randn(4, 64))
        engine.post_forward()
        seen = list(events)  # closing the engine gathers every bucket for good
    expected = []
    for number in range(3):  # a module's own bucket, then those ahead not yet started, then its forward
        expected += [i for i in own[: number + ahead + 1] if i not in expected]
        expected.append(f"forward {number}")
    assert seen == expected


# The token embedding's bucket, by bucket_numel (a bucket closes once it holds that many elements
# or more): at 1,152 the first block's LayerNorm (128) and the position embedding (1,024) close
# one, and the token embedding (8,192) gets a bucket of its own; at 9,344 the three share one, as
# in the example GPT at 6.7B, so the first block's backward needs the bucket again.
EMBEDDING_BUCKETS = {
    "own": (1152, ["wte.weight"]),
    "with_layernorm": (9344, ["blocks.0.0.bias", "blocks.0.0.weight", "wpe.weight", "wte.weight"]),
}


@pytest.mark.parametrize(
    ("tied", "layout"), [(True, "own"), (False, "own"), (True, "with_layernorm")], ids=["tied", "untied", "tied-shared"]
)
def test_the_embeddings_bucket_is_not_held_through_the_backward(tied, layout, benchmark_script, monkeypatch):
    torch.manual_seed(0)
    model = TiedGPT(vocab=128, width=64)
    if not tied:
        model.head.weight = nn.Parameter(model.wte.weight.detach().clone())
    started = []
    start = NodeShards._start
    monkeypatch.setattr(NodeShards, "_start", lambda self, index: (started.append(index), start(self, index))[1])
    bucket_numel, slots = EMBEDDING_BUCKETS[layout]
    config = {"bucket_numel": bucket_numel, "first_bucket_numel": bucket_numel, "weight_sharding": "node"}
    with emulated_engine(benchmark_script, model, **config) as engine:
        shards = engine.primary.node_shards
        embedding = next(b.layout.index for b in engine.buckets if any(p is model.wte.weight for p in b.params))
        assert [slot.name for slot in engine.buckets[embedding].layout.slots] == slots
        held_in_blocks_backward = []
        for block in model.blocks:
            block.register_full_backward_pre_hook(
                lambda m, g: held_in_blocks_backward.append(shards.gathered[embedding])
            )
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine.shard_optimizer(optimizer)
        for _ in range(2):
            engine.zero_grad()
            started.clear()
            held_in_blocks_backward.clear()
            engine.pre_forward()
            loss = model.loss(torch.randint(0, 128, (2, 9)))
            engine.post_forward()
            engine.pre_backward()
            loss.backward()
            engine.post_backward()
            assert held_in_blocks_backward == [False, False]
            # The forward's gather; the tied head's backward's; the first LayerNorm's backward's.
            assert started.count(embedding) == 1 + tied + (layout == "with_layernorm")
            assert not any(shards.gathered)
            engine.clip_grad_norm(1.0)
            engine.pre_optimizer_step()
            optimizer.step()
            engine.post_optimizer_step()


class _ReadBetweenItsModules(nn.Module):
    """`b.weight` read after a's forward and before b's; a and b share it (tied), so their bucket is
    released after their backward, not at its gradients."""

    def __init__(self):
        super().__init__()
        self.c, self.a, self.b = (nn.Linear(64, 64) for _ in range(3))
        self.b.weight = self.a.weight

    def forward(self, x):
        u = self.c(x)
        h = self.a(u)
        read = u @ self.b.weight.T  # the bucket gathered for a, and kept for b
        return self.b(h) + read


def test_a_read_between_its_modules_forwards_keeps_the_bucket_until_the_backward_ends(benchmark_script):
    torch.manual_seed(0)
    model = _ReadBetweenItsModules()
    with emulated_engine(benchmark_script, model, bucket_numel=64 * 64 + 2 * 64, weight_sharding="node") as engine:
        shards = engine.primary.node_shards
        bucket_of = {id(p): b.layout.index for b in engine.buckets for p in b.params}
        shared = bucket_of[id(model.b.weight)]
        assert bucket_of[id(model.a.weight)] == shared != bucket_of[id(model.c.weight)]
        engine.pre_forward()
        loss = model(torch.randn(4, 64)).square().mean()
        engine.post_forward()
        assert shared in shards.sticky and shards.gathered[shared]
        engine.pre_backward()
        loss.backward()
        engine.post_backward()
        assert not shards.sticky and not any(shards.gathered)
