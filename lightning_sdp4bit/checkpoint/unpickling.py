"""Reading a checkpoint's files without running the code a crafted one could carry.

Every file of a sharded checkpoint is a torch.save pickle. Unpickled without restriction, a
global in it (`builtins.exec`, `os.system`) is called as the file loads, and the manifest's
XXH3-64 checksums do not stop it: they are not keyed, so whoever writes the files can recompute
them. So every file is read with torch's `weights_only=True` unpickler, which builds tensors,
dtypes and plain containers and refuses any other global (besides those the user allowed with
`torch.serialization.add_safe_globals`). What this package writes needs nothing more:
- the shards: tensors, ints, strings, and the optimizers' state dicts (tensors and plain values);
- meta.pt: plain values, dtypes, tensors, and Lightning's own part of the checkpoint (loop and
  callback state, hyperparameters), which is plain unless the user put objects of their own in it.
meta.pt alone follows Lightning's `weights_only` argument (`fit`, `validate`, `test`, `predict`,
`load_from_checkpoint`): False is the user's word that they trust this checkpoint's Lightning state;
None keeps torch's default (True, unless TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from lightning_sdp4bit.checkpoint.files import CheckpointError, describe

__all__ = ["META_OPT_OUT", "SHARD_OPT_OUT", "load_restricted"]

# What a refusal tells a user who trusts the file.
META_OPT_OUT = (
    "pass weights_only=False to fit/validate/test/predict or load_from_checkpoint, or allow these "
    "types with torch.serialization.add_safe_globals"
)
SHARD_OPT_OUT = "allow these types with torch.serialization.add_safe_globals"


def load_restricted(file: Path, weights_only: bool | None = True, opt_out: str = SHARD_OPT_OUT) -> Any:
    """torch.load `file` onto the CPU with `weights_only` (None: torch's default). A global the
    unpickler refuses raises a CheckpointError naming the file and each refused global, nothing
    of it having run; any other failure one that says the file is unreadable."""
    try:
        return torch.load(file, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as error:
        refused = _refused_globals(file)
        if not refused:
            raise CheckpointError(f"{file}: unreadable ({describe(error)})") from None
        raise CheckpointError(
            f"{file}: refused: it holds {', '.join(refused)}, which loading with weights_only=True does not "
            f"allow (unpickling it could run code; nothing of it ran). If you trust this checkpoint, {opt_out}."
        ) from None
    except Exception as error:
        raise CheckpointError(f"{file}: unreadable ({describe(error)})") from error


def _refused_globals(file: Path) -> list[str]:
    """The globals in `file` that weights_only loading refuses, read from its pickle without
    running it; [] where the file cannot be read that far (then it is damaged, not refused)."""
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(file)
    except Exception:
        return []
