"""What a resume changes against the checkpoint: refused where the state cannot carry over,
said where it can.

- **Another optimizer class** (an AdamW checkpoint resumed with SGD): its state and parameter-group
  options are another optimizer's (SGD would fail at its first step with `KeyError: 'momentum'`).
  Refused at load, naming both classes (recorded in meta.pt since this version); for a
  checkpoint that does not name its class (an older one, an ordinary file), refused when a
  saved parameter group lacks an option the optimizer needs.
- **Another compression config** (another preset, other bits): the fp32 masters and optimizer
  state are exact whatever the config, so the resume goes on, with a warning that lists the
  fields that differ.
- **Files of different saves** (a manifest rebuilt by hand): each shard records the engine's step
  it was saved at, which must be meta.pt's.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from lightning_sdp4bit.checkpoint.files import CheckpointError

__all__ = ["check_optimizer", "check_step", "class_name", "warn_config_changes"]


def class_name(optimizer: torch.optim.Optimizer) -> str:
    """`torch.optim.adamw.AdamW`: the user's class (the sharded optimizer's class is a subclass
    with the same module and name, see `lightning_sdp4bit.optim`)."""
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def _needed_options(optimizer: torch.optim.Optimizer) -> set[str]:
    """The options every parameter group of this optimizer must hold: its defaults, less the
    flags (booleans, None) that torch's own `__setstate__` fills in for state dicts older than them."""
    return {key for key, value in optimizer.defaults.items() if value is not None and not isinstance(value, bool)}


def check_optimizer(
    index: int, optimizer: torch.optim.Optimizer, saved_groups: list[dict[str, Any]], saved_class: str | None
) -> None:
    """Refuse the state of another optimizer class for optimizer `index` (CheckpointError)."""
    current = class_name(optimizer)
    if saved_class is not None and saved_class != current:
        raise CheckpointError(
            f"optimizer {index}: the checkpoint holds the state of {saved_class}, the module's optimizer is "
            f"{current}; one's state does not carry over to the other. Resume with {saved_class}, or start "
            "from the weights alone (load_from_checkpoint, or consolidate_checkpoint's state_dict) and fit "
            "without ckpt_path"
        )
    needed = _needed_options(optimizer)
    for group in saved_groups:
        missing = sorted(needed - group.keys())
        if missing:
            held = sorted(key for key in group if key != "params")
            raise CheckpointError(
                f"optimizer {index} ({current}) needs the parameter-group options {missing}, which the "
                f"checkpoint's lack (it holds {held}): it was saved by another optimizer class. Resume with that "
                "class, or start from the weights alone and fit without ckpt_path"
            )


def check_step(file: Path, shard: dict[str, Any], meta: dict[str, Any]) -> None:
    """A shard saved at another engine step than meta.pt comes from another save (CheckpointError).
    Shards of checkpoints older than this check record no step."""
    if "step" in shard and shard["step"] != meta["engine_step"]:
        raise CheckpointError(
            f"{file} was saved at step {shard['step']}, meta.pt at step {meta['engine_step']}: the checkpoint "
            "mixes the files of different saves (a manifest rebuilt by hand?); load a checkpoint as one save wrote it"
        )


def warn_config_changes(path: Path, saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Warn, listing the fields, when the config the checkpoint was saved with differs from this
    run's (another preset, other bits, another bucket size): the resume itself is exact."""
    # A field the saving version did not have yet is no change.
    changed = [
        f"{name} {saved[name]!r} -> {value!r}" for name, value in current.items() if saved.get(name, value) != value
    ]
    if changed:
        warnings.warn(
            f"sdp4bit: {path} was saved with another SDP4BitConfig: {', '.join(changed)}. The fp32 master "
            "weights and the optimizer state resume exactly; the steps from here communicate as this run's "
            "config says.",
            stacklevel=3,
        )
