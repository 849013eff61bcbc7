"""The Trainer's launchers, finishing interrupted checkpoint saves before Lightning looks for them.

`fit(ckpt_path="last")` lists `last*.ckpt` in each ModelCheckpoint's folder while the launcher
runs the fit, before any strategy hook. A first save of `last.ckpt` that a crash stopped after
its commit, before its last rename, is complete at `last.ckpt.partial`, which that listing does
not see (see `lightning_sdp4bit.checkpoint.recovery`). These launchers rename it into place in
every process first, so "last" resumes from it. They also refuse a `ckpt_path` that names a
local path where nothing can be loaded: in the launching process before any worker starts, and
in a started rank (whose working directory or file system may differ) naming that rank and the
directory the path was resolved against. And they hand the entry point's `weights_only` to the
strategy (`entry_weights_only`), which Lightning 2.6 does not pass on to a strategy that restores
after its setup. Subclasses, not wrappers: Lightning tells the launchers apart by isinstance.
"""

from __future__ import annotations

import inspect
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_sdp4bit.checkpoint.load import complete_partial
from lightning_sdp4bit.checkpoint.recovery import finish_interrupted_save, finish_interrupted_saves
from lightning_sdp4bit.strategies import common

__all__ = [
    "MultiProcessingLauncher",
    "SubprocessScriptLauncher",
    "check_ckpt_path",
    "entry_argument",
    "finish_interrupted_checkpoint_saves",
]
# ckpt_path values that name no file: Lightning resolves them in each worker
_CKPT_PATH_NAMES = ("last", "best", "hpc")


def entry_argument(name: str, function: Callable, *args: Any, **kwargs: Any) -> Any:
    """The argument `name` that a Trainer entry point (`function`: Lightning's `_fit_impl`, ...)
    was called with; None where it has no such parameter (not a Trainer entry point)."""
    try:
        return inspect.signature(function).bind_partial(*args, **kwargs).arguments.get(name)
    except (TypeError, ValueError):
        return None


def check_ckpt_path(function: Callable, *args: Any, started_rank: int | None = None, **kwargs: Any) -> None:
    """The `ckpt_path` that fit, validate, test or predict (`function`, Lightning's `_fit_impl`,
    ...) was called with: a local path with neither a checkpoint nor a complete interrupted save
    of one (`path.partial`) raises FileNotFoundError, naming it. A name Lightning resolves
    ("last", "best", "hpc", "registry..."), a URL, or None passes. `started_rank`: the global
    rank of a process already started (by a launcher or torchrun), whose error names it, its host
    and its working directory; None in the process that starts the others."""
    path = entry_argument("ckpt_path", function, *args, **kwargs)
    if not isinstance(path, (str, os.PathLike)):
        return
    text = os.fspath(path)
    if text in _CKPT_PATH_NAMES or text.startswith("registry") or "://" in text:
        return
    if os.path.exists(text) or complete_partial(text) is not None:
        return
    missing = f"ckpt_path={text!r} does not exist, and no interrupted save left a complete {text}.partial"
    if started_rank is None:
        raise FileNotFoundError(f"{missing}: no process was started")
    where = "" if os.path.isabs(text) else f" (resolved against its working directory {os.getcwd()})"
    raise FileNotFoundError(
        f"rank {started_rank} on host {socket.gethostname()}: {missing} there: it looked for "
        f"{os.path.abspath(text)}{where}. Every rank must find the checkpoint: give an absolute path on a file "
        "system every rank sees"
    )


def finish_interrupted_checkpoint_saves(trainer: pl.Trainer) -> list[Path]:
    """Complete the interrupted first saves in the trainer's checkpoint folders (ModelCheckpoint
    folders, OnExceptionCheckpoint paths), warning for each; returns the paths completed."""
    finished: list[Path] = []
    for callback in common.callbacks_of(trainer):
        if isinstance(callback, ModelCheckpoint):
            # Where ModelCheckpoint itself looks for "last" (its dirpath, or the one it derives
            # from the logger and default_root_dir before setup).
            directory = callback.dirpath or callback._ModelCheckpoint__resolve_ckpt_dir(trainer)  # type: ignore[attr-defined]
            finished += finish_interrupted_saves(os.fspath(directory))
        elif isinstance(callback, OnExceptionCheckpoint) and finish_interrupted_save(callback.ckpt_path):
            finished.append(Path(callback.ckpt_path))
    for path in finished:
        rank_zero_warn(
            f"sdp4bit: {path} was complete at {path}.partial (a save interrupted just before its last rename): "
            "moved it into place"
        )
    return finished


class _FinishesInterruptedSaves:
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if trainer is not None:
            finish_interrupted_checkpoint_saves(trainer)
            # Trainer._run restores after the strategy's setup without its weights_only (2.6.6).
            trainer.strategy.entry_weights_only = entry_argument(  # type: ignore[attr-defined]  # ShardedCheckpoints'
                "weights_only", function, *args, **kwargs
            )
        check_ckpt_path(function, *args, started_rank=self._started_rank(), **kwargs)
        return super().launch(function, *args, trainer=trainer, **kwargs)  # type: ignore[misc]

    def _started_rank(self) -> int | None:
        """This process's global rank if a launcher or torchrun started it; None before any starts."""
        return None


class SubprocessScriptLauncher(_FinishesInterruptedSaves, _SubprocessScriptLauncher):
    """Lightning's popen launcher (the default)."""

    def _started_rank(self) -> int | None:
        environment = self.cluster_environment
        if not environment.creates_processes_externally:
            return None  # the launching process, whose children start after this check
        return environment.node_rank() * self.num_processes + environment.local_rank()


class MultiProcessingLauncher(_FinishesInterruptedSaves, _MultiProcessingLauncher):
    """Lightning's spawn / fork / forkserver launcher."""
