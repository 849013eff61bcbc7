"""The GPT as a LightningModule: loss, metrics, AdamW with weight-decay groups, cosine schedule.

Nothing here knows about SDP4Bit: the strategy shards and compresses behind Lightning's API, so
this module trains the same way under "ddp" or "sdp4bit".
"""

from __future__ import annotations

import functools
import math

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torchmetrics.text import Perplexity

from .model import GPT, GPTConfig


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Learning-rate multiplier: linear warmup to 1, then cosine decay to `min_ratio` at `total_steps`."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW parameter groups: weight decay on Linear weights only.

    Biases, norm weights and embeddings are not decayed. The tied lm_head weight *is* the token
    embedding, so it is not decayed either, and each parameter appears in exactly one group.
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)} - embeddings
    params = list(model.parameters())  # deduplicated: the tied weight comes once
    return [
        {"params": [p for p in params if id(p) in linear], "weight_decay": weight_decay},
        {"params": [p for p in params if id(p) not in linear], "weight_decay": 0.0},
    ]


class GPTModule(L.LightningModule):
    def __init__(self, model: dict, optim: dict) -> None:
        """`model` holds GPTConfig's fields; `optim` the YAML file's optim block."""
        super().__init__()
        self.save_hyperparameters()
        self.gpt = GPT(GPTConfig(**model))
        self.val_ppl = Perplexity()  # exp(mean cross-entropy over every validation token)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt(idx)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # fp32 cross-entropy even when the model runs in bf16
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = self._loss(self(inputs), targets)
        self.log("train/loss", loss, prog_bar=True)  # this process's loss; cheap every step
        return loss

    def on_validation_epoch_start(self) -> None:
        # Precision "bf16-true" casts every floating tensor of the module to bf16, metric states
        # included, and a bf16 sum over thousands of tokens is off by percents: sum in fp64.
        self.val_ppl.set_dtype(torch.float64)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        inputs, targets = batch
        self.val_ppl.update(self(inputs).float(), targets)  # sums -log p(target) and counts tokens

    def on_validation_epoch_end(self) -> None:
        # compute() sums the states of all processes, so every rank has the same value already;
        # sync_dist averages those equal values, which only keeps Lightning from warning
        ppl = self.val_ppl.compute()
        self.val_ppl.reset()
        self.log("val/loss", ppl.log().float(), prog_bar=True, sync_dist=True)  # mean cross-entropy per token
        self.log("val/ppl", ppl.float(), sync_dist=True)

    def configure_optimizers(self):
        o = self.hparams.optim
        optimizer = torch.optim.AdamW(
            decay_groups(self.gpt, o["weight_decay"]), lr=o["lr"], betas=(o["beta1"], o["beta2"])
        )
        schedule = functools.partial(
            warmup_cosine,
            warmup_steps=o["warmup_steps"],
            total_steps=self.trainer.max_steps,
            min_ratio=o["min_lr"] / o["lr"],
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
