"""When weight_sharding="node" gathers and releases buckets, in one process (rank 0 of an emulated
2 nodes x 4 job, `emulated.emulated_engine`), on a model of three linear layers in three buckets:
- in forward a module's pre-hook releases the buckets whose every user has run forward, so at each
  module's forward only its own bucket is gathered;
- the last module's bucket stays gathered into the backward, which starts with it: a step gathers
  the three buckets in forward and only the other two again in backward;
- after backward every bucket is released, and the next step does the same.
"""

import torch
from emulated import emulated_engine
from torch import nn

from lightning_sdp4bit.node_shards import NodeShards


def test_the_last_modules_bucket_serves_the_backward_without_a_second_gather(benchmark_script, monkeypatch):
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
            assert [i for i, g in enumerate(shards.gathered) if g] == [own[-1]]  # kept for the backward
            assert sorted(started) == [0, 1, 2]
            engine.pre_backward()
            loss.backward()
            engine.post_backward()
            assert sorted(started) == sorted([0, 1, 2, own[0], own[1]])  # the last layer's: not again
            assert not any(shards.gathered)
            engine.clip_grad_norm(1.0)
            engine.pre_optimizer_step()
            optimizer.step()
            engine.post_optimizer_step()
