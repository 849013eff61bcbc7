"""benchmarks/node_gathers.py, on the CPU:
- the scaled model's buckets hold the same parameters as the 6.7B model's (built on the meta
  device), at the default width and at twice it (below about 64 the norms and biases, which scale with
  the width, not its square, no longer fit the first bucket as at 6.7B);
- a run counts every bucket's gather in the forward, the most gathered at once is at least the
  largest bucket (the token embedding's) and at most all of them, the first gather of the forward
  waits unprefetched, the tied head's backward has at least the embedding's bucket gathered (and
  the loss's backward no more than it), and NodeShards' own steps are put back afterwards;
- the table has a row per prefetch depth and pass, and one per depth around the logits."""

import torch

from lightning_sdp4bit.node_shards import NodeShards


def test_the_scaled_model_has_the_6_7b_models_buckets(benchmark_script):
    script = benchmark_script("node_gathers")
    for width in (64, 128):
        spec, config = script.scaled_config(width, prefetch=2)
        assert script.same_layout_as_full(spec.build(torch.device("meta")), config), width


def test_a_run_counts_the_gathers_and_the_most_gathered(benchmark_script):
    script = benchmark_script("node_gathers")
    steps = (NodeShards._start, NodeShards._land, NodeShards.release)
    result = script.measure(width=64, prefetch=1, steps=2)
    assert (NodeShards._start, NodeShards._land, NodeShards.release) == steps
    assert result["same_layout"]
    forward = result["passes"]["forward"]
    layer = 12 * 64 * 64 + 13 * 64
    embedding = (786 + 32) * 64 + 2 * 64  # wte, wpe and the first LayerNorm: one bucket
    assert forward["gathers"] >= result["buckets"]
    assert embedding / layer <= forward["most_layers"] <= 33  # 32 blocks, the embeddings and the final norm
    assert forward["unprefetched"] >= 1
    around = result["around_the_logits_gib_at_6.7b"]
    embedding_gib = embedding * 64**2 * 2 / 2**30
    assert around[script.LOSS_BACKWARD] <= min(around[script.HEAD_BACKWARD], forward["most_gib_at_6.7b"])
    assert embedding_gib <= around[script.HEAD_BACKWARD] <= result["passes"]["backward"]["most_gib_at_6.7b"]
    table = script.report([result], 64).splitlines()
    rows = [line.split(" | ")[:2] for line in table if line.startswith("| 1 ")]
    assert rows == [["| 1", "forward"], ["| 1", "backward"], ["| 1", f"{around[script.LOSS_BACKWARD]:.2f}"]]
