"""weight_sharding="node" on a GPU, as rank 0 of an emulated 2 x 2 job (benchmarks/emulation.py):
the tiny GPT with each block checkpointed, so that buckets are gathered before the forward, again
in the recomputed forward and before backward (from the autograd engine's device thread), and
released after each. Over 3 steps: every loss finite, every bucket released between steps, the
gathers counted, half the weights' bytes held (L = 2), and the allocated memory the same after
steps 2 and 3. (Between steps at this size the node mode's allocated memory read 46 MB above the
replicated mode's on the H200, not on the CPU; at 6.7B and 65B it matched what the engine holds
to 0.5%: benchmarks/results/node_sharding_h200_2026-12-04.md.)"""

import pytest
import torch

pytestmark = pytest.mark.gpu


def _steps(benchmark_script, mode):
    emulated_runs = benchmark_script("emulated_runs")
    gpt_step = benchmark_script("gpt_step")
    emulation = benchmark_script("emulation")
    from lightning_sdp4bit import SDP4BitConfig
    from lightning_sdp4bit.engine import ShardedEngine
    from lightning_sdp4bit.topology import Topology

    device, topology = torch.device("cuda"), Topology(0, 4, 2)
    # 8.4M parameters: the 17 MB of bf16 weights stand well above the allocator's noise.
    spec = emulated_runs.ModelSpec(2, 512, batch=2, seq=64, n_head=8, vocab=4096, checkpoint=True)
    network = emulation.Network(device, topology)
    out = {"losses": [], "released": [], "gathered_bytes": [], "allocated": []}
    with network.install():
        model = spec.build(torch.device("meta") if mode == "node" else device)
        config = SDP4BitConfig.preset("sdp4bit", ranks_per_node=2, weight_sharding=mode, bucket_numel=2_000_000)
        engine = ShardedEngine(model, config, topology, network.groups(), device=device)
        optimizer = gpt_step.make_optimizer(model.parameters(), device)
        engine.shard_optimizer(optimizer)
        tokens = spec.tokens(device)
        for _ in range(3):
            loss, stats = gpt_step.engine_step(model, engine, optimizer, tokens)
            torch.cuda.synchronize()
            out["losses"].append(loss.item())
            shards = engine.primary.node_shards
            out["released"].append(shards is None or not any(shards.gathered))
            out["gathered_bytes"].append(stats["weight_gather_bytes"])
            out["allocated"].append(torch.cuda.memory_allocated())
        out["weights"] = sum(b.held_weights.nbytes for b in engine.buckets)
        out["buckets"] = len(engine.buckets)
        engine.close()
    return out


def test_the_node_mode_gathers_and_releases_on_a_gpu(benchmark_script):
    replicated = _steps(benchmark_script, "replicated")
    node = _steps(benchmark_script, "node")
    assert node["buckets"] > 1
    assert all(torch.isfinite(torch.tensor(node["losses"])))
    assert all(node["released"])
    assert all(count > 0 for count in node["gathered_bytes"]) and not any(replicated["gathered_bytes"])
    assert node["weights"] * 2 == replicated["weights"]
    # Nothing accumulates from step to step (a gathered bucket kept, a landing buffer never freed).
    assert node["allocated"][2] == node["allocated"][1]
