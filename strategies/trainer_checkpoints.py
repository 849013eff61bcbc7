"""The Trainer adapter's checkpoints: `SDP4BitStrategy`'s save, load and remove, mapped to
`lightning_sdp4bit.checkpoint` (sharded directories; ordinary files too).

A mixin of `SDP4BitStrategy` (listed before Lightning's base class, so that these methods take
the place of ParallelStrategy's): it reads `engine`, `optimizers`, `checkpoint_io`, `barrier`,
`is_global_zero` and `_wait_weights` from the strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_sdp4bit import checkpoint as sharded_checkpoint
from lightning_sdp4bit.checkpoint.files import agree, describe
from lightning_sdp4bit.strategies import common

if TYPE_CHECKING:
    from lightning.pytorch.strategies import ParallelStrategy

    from lightning_sdp4bit.config import SDP4BitConfig
    from lightning_sdp4bit.engine import ShardedEngine

    _Strategy = ParallelStrategy  # the type checker sees the strategy this mixin is part of
else:
    _Strategy = object

__all__ = ["ShardedCheckpoints"]

_SHARDED_KEY = "sdp4bit_checkpoint_dir"  # marks a checkpoint dict loaded from a sharded directory
_GENERATION_KEY = "sdp4bit_checkpoint_generation"  # the generation its meta.pt was read from
_WEIGHTS_ONLY_KEY = "sdp4bit_weights_only"  # Lightning's weights_only, for meta.pt when the shards load


class ShardedCheckpoints(_Strategy):
    """Lightning's checkpoint hooks of a strategy, for sharded checkpoint directories."""

    entry_weights_only: bool | None = None
    """The `weights_only` that fit / validate / test / predict was called with, which Lightning
    2.6 does not pass to `load_checkpoint` of a strategy that restores after its setup (as this
    one must); the strategy's launcher records it (`launchers.entry_argument`)."""
    # SDP4BitStrategy's, declared for the type checker (annotations only: nothing at run time).
    engine: ShardedEngine | None
    config: SDP4BitConfig
    _wait_weights: Callable[[], None]

    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._wait_weights()
        if self.engine is not None and self.config.shards_weights:
            # The shards hold the weights; the parameters stand in for them (a hook that reads one
            # gathers its bucket). state_dict() would detach, i.e. read, each: the whole model at once.
            # (Without an engine, save_checkpoint writes this dict itself: copies, as usual.)
            module = self.lightning_module
            assert module is not None
            return module.state_dict(keep_vars=True)
        return super().lightning_module_state_dict()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write a sharded checkpoint directory at `filepath` (see lightning_sdp4bit.checkpoint)."""
        if storage_options is not None:
            raise TypeError("the sdp4bit strategy writes sharded directories and takes no storage_options")
        if self.engine is None:
            # E.g. the spawn launcher's main process after fit: it holds the final weights only.
            rank_zero_warn(
                "sdp4bit: no sharded training state in this process (outside fit, or in the spawn launcher's "
                "main process after fit); writing an ordinary checkpoint of the module's weights without "
                "optimizer shards. Save inside fit (ModelCheckpoint) for a resumable checkpoint."
            )
            if self.is_global_zero:
                self.checkpoint_io.save_checkpoint(checkpoint, filepath)
            return
        optimizers = [_unwrap(opt) for opt in self.optimizers]
        common.save_sharded(self.engine, optimizers, checkpoint, filepath, self.barrier)

    def remove_checkpoint(self, filepath: Any) -> None:
        # Also the `.partial` / `.old` leftovers of an interrupted save beside it.
        if self.is_global_zero:
            sharded_checkpoint.remove_checkpoint(filepath)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Collective: every rank reads and verifies, then all agree, so that one rank's failure is
        the same CheckpointError on every rank instead of a peer's socket error later. Every file
        is read without running code; `weights_only` (or the entry point's) applies to meta.pt
        (`lightning_sdp4bit.checkpoint.unpickling`)."""
        if weights_only is None:
            weights_only = self.entry_weights_only
        path = sharded_checkpoint.find_checkpoint(checkpoint_path)
        if not path.is_dir():
            checkpoint, error = None, None
            try:
                checkpoint = super().load_checkpoint(path, weights_only=weights_only)
            except Exception as caught:
                error = f"{path}: {describe(caught)}"
            agree(error, timeouts=common.timeouts_of(self))
            assert checkpoint is not None  # agree raised on every rank otherwise
            return checkpoint
        meta = sharded_checkpoint.read_meta(
            path, collective=True, timeouts=common.timeouts_of(self), weights_only=weights_only
        )
        marks = {_SHARDED_KEY: str(path), _GENERATION_KEY: meta["generation"], _WEIGHTS_ONLY_KEY: weights_only}
        if meta["lightning"].get(common.SAVED_BY_FABRIC) is not None:
            # Fabric's loop has no Trainer state to give: the weights, master weights, optimizer
            # state and the engine's step resume; Lightning's loops and schedulers start afresh.
            rank_zero_warn(
                f"sdp4bit: {path} was written by Fabric; resuming its weights, optimizer state and "
                "communication step. The Trainer's loop counters, LR schedulers and callbacks start afresh "
                f"(Fabric's other entries {sorted(k for k in meta['lightning'] if k != common.SAVED_BY_FABRIC)} "
                "are not read)."
            )
            return {
                "pytorch-lightning_version": pl.__version__,
                "state_dict": meta["untrained_state"],
                "optimizer_states": [],
                "lr_schedulers": [],
                **marks,
            }
        # The heavy tensors stay on disk until load_model_state_dict / load_optimizer_state_dict.
        return {
            **meta["lightning"],
            "state_dict": meta["untrained_state"],
            "optimizer_states": [],
            **marks,
        }

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        module = self.lightning_module
        assert module is not None
        # Fitting, the optimizers exist already (restore_checkpoint_after_setup), so their state
        # is restored in the same pass as the weights; load_optimizer_state_dict has nothing left.
        # Everything is checked before anything in the module changes.
        optimizers = [_unwrap(opt) for opt in self.optimizers] if self.engine is not None else None
        if _SHARDED_KEY in checkpoint:
            path, weights_only = checkpoint[_SHARDED_KEY], checkpoint.get(_WEIGHTS_ONLY_KEY)
            if self.engine is not None:
                # The shards of the generation load_checkpoint read the loop state from.
                sharded_checkpoint.load_sharded(
                    self.engine, optimizers, path, checkpoint.get(_GENERATION_KEY), weights_only
                )
                module.load_state_dict(checkpoint["state_dict"], strict=False)
                # A tied weight's second name writes the loaded value again: no user write.
                self.engine.weights_loaded()
            else:
                full = sharded_checkpoint.read_full_state(path, weights_only)
                aliases = full["meta"].get("aliases", {})  # a tied parameter's second names
                weights = {**full["weights"], **{alias: full["weights"][name] for alias, name in aliases.items()}}
                state_dict = {**checkpoint["state_dict"], **weights}
                sharded_checkpoint.check_state_dict(module, state_dict, strict)
                module.load_state_dict(state_dict, strict=strict)
            return
        sharded_checkpoint.check_state_dict(module, checkpoint["state_dict"], strict)
        if self.engine is None:
            module.load_state_dict(checkpoint["state_dict"], strict=strict)
            return
        # A weights-only checkpoint has no optimizer states: then the masters alone are restored.
        common.load_ordinary_state(
            self.engine, optimizers, checkpoint["state_dict"], checkpoint.get("optimizer_states", [])
        )
        # Stochastic rounding seeds derive from the engine's step: continue the count, not restart
        # it (a checkpoint without "global_step" holds no training progress: step 0).
        self.engine.restore_step(int(checkpoint.get("global_step", 0)))

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing to do: load_model_state_dict restored the optimizers' shards with the weights."""


def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
