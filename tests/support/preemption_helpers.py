"""SIGTERM at a chosen instant of a Lightning fit, for the preemption tests: at a file operation
of a save (through checkpoint_helpers.FileOps), or in backward while bucket exchanges are in
flight. Used in-process by tests/integration/test_preemption.py and by
tests/support/preemption_script.py."""

from __future__ import annotations

import os
import signal
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

from checkpoint_helpers import FileOps


def sigterm_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


@contextmanager
def sigterm_in_save(strategy_class: type, rank: int, at: str, step: int) -> Generator[None, None, None]:
    """While active, `strategy_class.save_checkpoint` records the file operations of the save
    after step `step - 1` and, in the save after step `step`, makes rank `rank` SIGTERM itself
    just before the first operation matching `at` ("name" or "name:file", e.g. "fsync" or
    "open:manifest.json.tmp"); the operation then runs, as it would after a signal handler."""
    name, _, label = at.partition(":")
    recorded: list[tuple[str, str]] = []
    original = strategy_class.save_checkpoint

    def save_checkpoint(self: Any, checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
        saved_step = checkpoint["global_step"]
        if saved_step == step - 1:
            with FileOps() as ops:
                original(self, checkpoint, filepath, storage_options)
            recorded[:] = ops.ops
            return
        if saved_step != step or self.global_rank != rank:
            return original(self, checkpoint, filepath, storage_options)
        matches = [i for i, op in enumerate(recorded) if op[0] == name and (not label or op[1] == label)]
        if not matches:
            raise AssertionError(f"rank {rank}: no file operation {at!r} in a save: {recorded}")
        with FileOps(fail_at=matches[0], action=sigterm_self, proceed=True):
            original(self, checkpoint, filepath, storage_options)

    strategy_class.save_checkpoint = save_checkpoint
    try:
        yield
    finally:
        strategy_class.save_checkpoint = original


def sigterm_in_backward(rank: int, step: int) -> Any:
    """A Callback: in the backward that makes step `step`, rank `rank` SIGTERMs itself from the
    post-accumulate-grad hook of the token embedding (registered first, so its gradient is among
    the last of backward, after the later layers' buckets started their exchanges)."""
    from lightning.pytorch.callbacks import Callback

    class SigtermInBackward(Callback):
        handle = None

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step + 1 == step and trainer.global_rank == rank and self.handle is None:
                self.handle = module.model.embed.weight.register_post_accumulate_grad_hook(lambda p: sigterm_self())

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.handle is not None:
                self.handle.remove()
                self.handle = None

    return SigtermInBackward()
