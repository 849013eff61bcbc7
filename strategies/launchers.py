"""The Trainer's launchers, finishing interrupted checkpoint saves before Lightning looks for them.

`fit(ckpt_path="last")` lists `last*.ckpt` in each ModelCheckpoint's folder while the launcher
runs the fit, before any strategy hook. A first save of `last.ckpt` that a crash stopped after
its commit, before its last rename, is complete at `last.ckpt.partial`, which that listing does
not see (see `lightning_sdp4bit.checkpoint.recovery`). These launchers rename it into place in
every process first, so "last" resumes from it. They also refuse, before any worker starts, a
`ckpt_path` that names a local path where nothing can be loaded (every worker would fail the
same way after its setup). Subclasses, not wrappers: Lightning tells the launchers apart by
isinstance.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_sdp4bit.checkpoint.load import complete_partial
from lightning_sdp4bit.checkpoint.recovery import finish_interrupted_save, finish_interrupted_saves

__all__ = [
    "MultiProcessingLauncher",
    "SubprocessScriptLauncher",
    "check_ckpt_path",
    "finish_interrupted_checkpoint_saves",
]
# ckpt_path values that name no file: Lightning resolves them in each worker
_CKPT_PATH_NAMES = ("last", "best", "hpc")


def check_ckpt_path(function: Callable, *args: Any, **kwargs: Any) -> None:
    """The `ckpt_path` that fit, validate, test or predict (`function`, Lightning's `_fit_impl`,
    ...) was called with: a local path with neither a checkpoint nor a complete interrupted save
    of one (`path.partial`) raises FileNotFoundError, naming it. A name Lightning resolves
    ("last", "best", "hpc", "registry..."), a URL, or None passes."""
    try:
        path = inspect.signature(function).bind_partial(*args, **kwargs).arguments.get("ckpt_path")
    except (TypeError, ValueError):  # not a Trainer entry point: nothing to check
        return
    if not isinstance(path, (str, os.PathLike)):
        return
    text = os.fspath(path)
    if text in _CKPT_PATH_NAMES or text.startswith("registry") or "://" in text:
        return
    if not os.path.exists(text) and complete_partial(text) is None:
        raise FileNotFoundError(
            f"ckpt_path={text!r} does not exist, and no interrupted save left a complete {text}.partial: "
            "no process was started"
        )


def finish_interrupted_checkpoint_saves(trainer: pl.Trainer) -> list[Path]:
    """Complete the interrupted first saves in the trainer's checkpoint folders (ModelCheckpoint
    folders, OnExceptionCheckpoint paths), warning for each; returns the paths completed."""
    finished: list[Path] = []
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # set by Lightning's callback connector
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
        check_ckpt_path(function, *args, **kwargs)
        return super().launch(function, *args, trainer=trainer, **kwargs)  # type: ignore[misc]


class SubprocessScriptLauncher(_FinishesInterruptedSaves, _SubprocessScriptLauncher):
    """Lightning's popen launcher (the default)."""


class MultiProcessingLauncher(_FinishesInterruptedSaves, _MultiProcessingLauncher):
    """Lightning's spawn / fork / forkserver launcher."""
