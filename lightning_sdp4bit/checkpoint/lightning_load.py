"""`LightningModule.load_from_checkpoint` on a sharded checkpoint directory.

Lightning reads the file with `lightning.fabric.utilities.cloud_io._load`, imported into
`lightning.pytorch.core.saving` as `pl_load`; on a directory that opens it and raises a bare
IsADirectoryError. `import lightning_sdp4bit` replaces that name (and only that one, when the
module loads: `lightning_sdp4bit._registration`) by `load_sharded_or_file`, so that
`MyModule.load_from_checkpoint("x.ckpt")` loads a sharded directory as `consolidate_checkpoint`
gives it: every file verified, the fp32 master weights in "state_dict", meta.pt read with the
`weights_only` Lightning passes. Anything else goes to Lightning's own loader unchanged.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_sdp4bit.checkpoint.consolidate import consolidate_checkpoint
from lightning_sdp4bit.checkpoint.files import MANIFEST, sibling
from lightning_sdp4bit.checkpoint.load import find_checkpoint

__all__ = ["sharded_aware"]


def _ours(path: Path) -> bool:
    """A directory this package wrote (complete or not), or the `.partial` an interrupted save left."""
    return (path / MANIFEST).exists() or (not path.exists() and (sibling(path, ".partial") / MANIFEST).exists())


def sharded_aware(load: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap Lightning's checkpoint loader: a sharded directory is consolidated (its tensors on the
    CPU; Lightning moves the module afterwards), a damaged one raises its CheckpointError."""

    @functools.wraps(load)
    def load_sharded_or_file(path_or_url: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
        if isinstance(path_or_url, (str, os.PathLike)) and _ours(Path(path_or_url)):
            return consolidate_checkpoint(find_checkpoint(path_or_url), weights_only=weights_only)
        return load(path_or_url, map_location=map_location, weights_only=weights_only)

    return load_sharded_or_file
