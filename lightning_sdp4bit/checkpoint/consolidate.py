"""Turning a sharded checkpoint into one ordinary Lightning checkpoint (every file verified)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import Tensor

from lightning_sdp4bit.checkpoint.files import checksummed_save
from lightning_sdp4bit.checkpoint.load import read_full_state

__all__ = ["consolidate_checkpoint"]


WEIGHT_SOURCES = ("masters", "module")


def consolidate_checkpoint(
    path: str | os.PathLike,
    output: str | os.PathLike | None = None,
    weights: str = "masters",
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Turn a sharded checkpoint directory into one ordinary Lightning checkpoint dict.

    Its "state_dict" (the trained parameters plus buffers and frozen parameters) loads into the
    plain LightningModule, and its "optimizer_states" are per-parameter, in the optimizers' own
    parameter order, so that another strategy can resume from it. Written to `output` when given
    (under a temporary name, then renamed). Raises CheckpointError if a file is missing, damaged
    or misplaced.

    `weights` picks the trained parameters' values:
    - "masters" (default): the fp32 master weights, what the optimizer steps and training resumes
      from (writes to the weights by hooks and callbacks are in them);
    - "module": the module's weights every replica held, in the module's dtype: what the model
      computed with (after qWD, the masters' 4-bit-exchanged copy; under bf16-true, rounded).

    `weights_only`: as Lightning's, for meta.pt (the shards are always read with weights_only=True;
    see `lightning_sdp4bit.checkpoint.unpickling`).
    """
    if weights not in WEIGHT_SOURCES:
        raise ValueError(f"consolidate_checkpoint: weights must be one of {WEIGHT_SOURCES}, got {weights!r}")
    full = read_full_state(path, weights_only)
    meta = full["meta"]  # of the generation the full state was read from
    trained = dict(full["masters"]) if weights == "masters" else {**full["masters"], **full["weights"]}
    # A tied parameter's second name holds the same values (saved among the untrained entries).
    trained.update({alias: trained[name] for alias, name in meta.get("aliases", {}).items()})
    state_dict = {**meta["untrained_state"], **trained}
    optimizer_states = []
    for saved, groups in zip(full["optimizers"], meta["optimizer_param_names"], strict=True):
        names = [name for group in groups for name in group]
        state = {}
        for index, name in enumerate(names):
            shape = full["masters"][name].shape
            entries = saved["state"].get(name)
            if entries:
                state[index] = {
                    k: v.view(shape) if isinstance(v, Tensor) and v.dim() > 0 else v for k, v in entries.items()
                }
        param_groups, position = [], 0
        for saved_group, group_names in zip(saved["param_groups"], groups, strict=True):
            ids = list(range(position, position + len(group_names)))
            position += len(group_names)
            param_groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": ids})
        optimizer_states.append({"state": state, "param_groups": param_groups})
    checkpoint = {**meta["lightning"], "state_dict": state_dict, "optimizer_states": optimizer_states}
    if output is not None:
        output = Path(output)
        temporary = output.with_name(output.name + ".tmp")
        checksummed_save(checkpoint, temporary)  # flushed, and a full disk named as such
        os.replace(temporary, output)
    return checkpoint
