"""Lightning contracts of issue 27, against DDPStrategy on the same seed (2 CPU ranks, fp32; one
set of processes for every case):
- `p.grad = None` set in on_before_optimizer_step makes the optimizer skip that parameter that
  step, as under DDP (AdamW with weight decay shows the difference), bit for bit under baseline.
"""

import torch
from distributed import run_workers
from lightning_runs import ddp, make_trainer, sdp4bit, weights
from models import TinyLMModule


class DropsEmbeddingGrad(TinyLMModule):
    """Sets the tied embedding's gradient to None on odd steps: AdamW must skip it then."""

    def on_before_optimizer_step(self, optimizer):
        if self.global_step % 2 == 1:
            self.model.embed.weight.grad = None


def _contracts(rank, world):
    out = {}
    for name, make in (("ddp", ddp), ("baseline", lambda: sdp4bit(preset="baseline"))):
        module = DropsEmbeddingGrad()
        make_trainer(world, make(), max_steps=4).fit(module)
        out[f"grad_none_{name}"] = weights(module)
    return out


def test_lightning_contracts():
    for result in run_workers(_contracts, 2):
        for name, expected in result["grad_none_ddp"].items():
            assert torch.equal(result["grad_none_baseline"][name], expected), name
