"""Helpers that run Lightning Fabric loops inside `distributed.run_workers` processes, as torchrun
would (the process group exists, LOCAL_RANK is set, so `fabric.launch()` starts nothing itself)."""

from __future__ import annotations

import os
from typing import Any

import torch
from models import VOCAB, batch, make_model
from torch.nn import functional as F

BUCKET_NUMEL = 3000  # several buckets for the tiny model, as in the Trainer tests


def make_fabric(world: int, strategy: Any, **kwargs: Any):
    from lightning.fabric import Fabric

    os.environ["LOCAL_RANK"] = str(torch.distributed.get_rank())
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy, **kwargs)
    fabric.launch()
    return fabric


def sdp4bit(**config: Any):
    import lightning_sdp4bit

    return lightning_sdp4bit.SDP4BitFabricStrategy(config={"bucket_numel": BUCKET_NUMEL, **config})


def setup(fabric):
    """TinyLM with AdamW (decay / no-decay groups) and a per-step LR schedule, as the Trainer tests."""
    model = make_model(0)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay}], lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 0.1 * step))
    return model, optimizer, schedule


def loss_of(model, tokens: torch.Tensor, scale: float) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return scale * F.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))


def train(
    fabric,
    model,
    optimizer,
    schedule,
    steps: range,
    accumulate: int = 2,
    clip: float | None = 1.0,
    no_sync: bool = True,
    set_to_none: bool = True,
):
    """`accumulate` micro-batches per step (all but the last under no_backward_sync unless
    `no_sync` is False: then every backward reduces, as Fabric's DDP allows), clip by norm."""
    # 0.05 keeps the global gradient norm under 1, so clipping runs but scales by exactly 1.
    for step in steps:
        for micro in range(accumulate):
            with fabric.no_backward_sync(model, enabled=no_sync and micro < accumulate - 1):
                fabric.backward(loss_of(model, batch(fabric.global_rank, step, micro), 0.05))
        if clip is not None:
            fabric.clip_gradients(model, optimizer, max_norm=clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        schedule.step()


def weights(fabric, model) -> dict[str, torch.Tensor]:
    """By the user's own parameter names (model.module is the module given to fabric.setup), once
    the last step's weight all-gathers have arrived."""
    if hasattr(fabric.strategy, "wait_weights"):
        fabric.strategy.wait_weights()
    return {n: p.detach().float().clone() for n, p in model.module.named_parameters()}
