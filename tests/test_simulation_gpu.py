"""The simulation on a GPU (skipped without CUDA):
- each rank's forward and backward replayed from a CUDA graph gives the eager pass's gradients:
  3 simulated steps of sdp4bit at 2 x 2 end with the same masters and weights, bit for bit;
- a micro-batch of another shape is refused by name.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path[:0] = [
    str(Path(__file__).resolve().parents[1] / "benchmarks"),
    str(Path(__file__).resolve().parents[1] / "examples"),
]

pytestmark = pytest.mark.gpu


def _train(graphed: bool):
    from accuracy_gpu import RankPasses, Study, build

    study = Study(n_layer=2, n_embd=128, n_head=4, block_size=256, world="2x2")
    device = torch.device("cuda")
    model, engine, _, _ = build(study, "sdp4bit", 0, device)
    tokens = torch.randint(
        0, 256, (3, study.ranks, 1, study.block_size + 1), generator=torch.Generator().manual_seed(0)
    )
    tokens = tokens.to(device)
    passes = RankPasses(model, engine, tokens[0, 0], graphed)
    for step in range(3):
        for rank in range(study.ranks):
            passes(rank, tokens[step, rank])
        engine.optimizer_step(max_norm=1.0)
    masters = [b.master.clone() for rank in engine.ranks for b in rank.buckets]
    return masters, [p.detach().clone() for p in model.parameters()], passes


def test_graph_replay_gives_the_eager_bits():
    eager_masters, eager_weights, _ = _train(graphed=False)
    masters, weights, passes = _train(graphed=True)
    assert all(torch.equal(a, b) for a, b in zip(eager_masters, masters, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(eager_weights, weights, strict=True))
    with pytest.raises(ValueError, match=r"captured for a micro-batch of shape \(1, 257\)"):
        passes(0, torch.zeros(2, 257, dtype=torch.long, device="cuda"))
