"""The simulation on a GPU (skipped without CUDA):
- each rank's forward and backward replayed from a CUDA graph gives the eager pass's gradients:
  3 simulated steps of sdp4bit at 2 x 2 end with the same masters, weights and losses, bit for
  bit, whether the graphs replay one rank at a time or three at once on their own streams (4 ranks
  over 3 copies: the first copy serves ranks 0 and 3, so its reuse is ordered after the intake),
  and two at once at the study's width (768), where cuBLAS may use its workspace;
- a micro-batch of another shape is refused by name.
"""

import sys
from pathlib import Path

import pytest
import torch

from lightning_sdp4bit.simulation.graphed import GraphedRanks

sys.path[:0] = [
    str(Path(__file__).resolve().parents[2] / "benchmarks"),
    str(Path(__file__).resolve().parents[2] / "examples"),
]

pytestmark = pytest.mark.gpu


def _train(graphed: bool, streams: int = 1, width: int = 128):
    from accuracy_gpu import RankPasses, Study, build

    study = Study(n_layer=2, n_embd=width, n_head=4, block_size=256, world="2x2")
    device = torch.device("cuda")
    model, engine, _, _ = build(study, "sdp4bit", 0, device)
    tokens = torch.randint(
        0, 256, (3, study.ranks, 1, study.block_size + 1), generator=torch.Generator().manual_seed(0)
    )
    tokens = tokens.to(device)
    passes = RankPasses(model, engine, tokens[0, 0], graphed, streams)
    losses = []
    for step in range(3):
        losses.append(torch.zeros((), device=device))
        passes.step(tokens[step], losses[-1])
        engine.optimizer_step(max_norm=1.0)
    masters = [b.master.clone() for rank in engine.ranks for b in rank.buckets]
    return masters, [p.detach().clone() for p in model.parameters()], torch.stack(losses)


@pytest.mark.parametrize("streams, width", [(1, 128), (3, 128), (2, 768)])
def test_graph_replay_gives_the_eager_bits(streams, width):
    eager_masters, eager_weights, eager_losses = _train(graphed=False, width=width)
    masters, weights, losses = _train(graphed=True, streams=streams, width=width)
    assert all(torch.equal(a, b) for a, b in zip(eager_masters, masters, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(eager_weights, weights, strict=True))
    assert torch.equal(eager_losses, losses)


def test_a_micro_batch_of_another_shape_is_refused():
    model = torch.nn.Linear(4, 1).cuda()
    ranks = GraphedRanks(lambda t: model(t).sum(), torch.zeros(2, 4, device="cuda"), list(model.parameters()), 2)
    with pytest.raises(ValueError, match=r"captured for a micro-batch of shape \(2, 4\)"):
        ranks.run([torch.zeros(3, 4, device="cuda")], lambda *_: None)
