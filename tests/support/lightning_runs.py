"""Helpers that run Lightning fits inside `distributed.run_workers` processes, as torchrun would
(the process group exists, LOCAL_RANK is set, so Lightning launches nothing itself)."""

from __future__ import annotations

import os
from typing import Any

import torch

TRAINER_DEFAULTS = dict(
    accelerator="cpu",
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    limit_val_batches=0,
    num_sanity_val_steps=0,
)


def make_trainer(world: int, strategy: Any, **kwargs: Any):
    import lightning.pytorch as pl

    os.environ["LOCAL_RANK"] = str(torch.distributed.get_rank())
    return pl.Trainer(devices=world, strategy=strategy, **{**TRAINER_DEFAULTS, **kwargs})


def sdp4bit(**config: Any):
    import lightning_sdp4bit  # noqa: F401  (registers the strategy)
    from lightning_sdp4bit import SDP4BitStrategy

    return SDP4BitStrategy(config={"bucket_numel": 3000, **config})


def ddp():
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy()


def weights(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in module.model.named_parameters()}
