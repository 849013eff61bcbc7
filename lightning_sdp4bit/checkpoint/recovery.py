"""Finishing a first save that was interrupted after its commit, before its last rename.

The first save of a name is written as `x.ckpt.partial` and committed there (its manifest), then
renamed to `x.ckpt`. A crash between the two leaves the complete checkpoint at `x.ckpt.partial`,
where nothing that looks for checkpoints by name (Lightning's `ckpt_path="last"`, which lists
`last*.ckpt`) finds it. `finish_interrupted_save` does the rename the crash prevented; the
strategy's launcher calls `finish_interrupted_saves` on every checkpoint folder before Lightning
resolves "last", the next save to the path does it too, and loading a path finds the `.partial`.
"""

from __future__ import annotations

import os
from pathlib import Path

from lightning_sdp4bit.checkpoint.files import is_sharded_checkpoint, sibling, sync_directory
from lightning_sdp4bit.checkpoint.lock import held_by_live_writer, remove_stale_in

__all__ = ["PARTIAL", "finish_interrupted_save", "finish_interrupted_saves"]

PARTIAL = ".partial"


def finish_interrupted_save(path: str | os.PathLike) -> bool:
    """Rename a complete `path.partial` to `path` where nothing stands at `path`; True if it did.
    Safe on every rank at once (one rename wins, the others find the `.partial` gone) and beside a
    live writer of the path (whose save in progress is left alone)."""
    path = Path(path)
    partial = sibling(path, PARTIAL)
    if path.exists() or path.is_symlink() or not is_sharded_checkpoint(partial) or held_by_live_writer(path):
        return False
    try:
        os.replace(partial, path)
    except FileNotFoundError:
        return False  # another rank renamed it first
    sync_directory(path.parent)
    return True


def finish_interrupted_saves(directory: str | os.PathLike) -> list[Path]:
    """`finish_interrupted_save` for every `*.partial` in `directory`, and removal of the locks
    whose writers are provably gone (`lock.remove_stale_in`); the paths it completed."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    partials = [entry for entry in directory.iterdir() if entry.name.endswith(PARTIAL)]
    finished = [
        target for target in (p.with_name(p.name[: -len(PARTIAL)]) for p in partials) if finish_interrupted_save(target)
    ]
    remove_stale_in(directory)
    return finished
