"""`SDP4BitFabricStrategy`: the Lightning Fabric adapter over `lightning_sdp4bit.engine.ShardedEngine`.

    fabric = Fabric(strategy="sdp4bit", devices=8, precision="bf16-true")   # after `import lightning_sdp4bit`
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)

The same engine, config and checkpoint directory as the Trainer's `SDP4BitStrategy`; what both
decide alike is in `common`. Fabric's calls map onto the engine's step protocol
(`lightning_sdp4bit.engine`):
- `setup_module`: builds the engine over the module (collective: rank 0's weights are broadcast)
  and hooks the module's own forward (what DDP's wrapper wraps) with `pre_forward` / `post_forward`;
- `setup_optimizer`: `shard_optimizer` re-points the optimizer at the fp32 master fragments;
- `backward`: `pre_backward`, backward (the gradient hooks reduce-scatter bucket by bucket),
  `post_backward`; inside `fabric.no_backward_sync(model)` (`no_sync`) the micro-batch only accumulates;
- `clip_gradients(max_norm=... | clip_val=...)`: `clip_grad_norm` (the global norm over all
  shards) or `clip_grad_value`;
- `optimizer.step()`: `pre_optimizer_step`, the master fragments step, `post_optimizer_step`;
- `save` / `load`: the sharded directory of `lightning_sdp4bit.checkpoint`;
- `teardown`: `close`.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl, _validate_keys_for_strict_loading
from lightning.fabric.utilities.types import _Stateful
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_sdp4bit import checkpoint as sharded_checkpoint
from lightning_sdp4bit.config import SDP4BitConfig
from lightning_sdp4bit.engine import ShardedEngine
from lightning_sdp4bit.stats import WireMeter
from lightning_sdp4bit.strategies import common

__all__ = ["SDP4BitFabricStrategy"]


class SDP4BitFabricStrategy(common.DataParallelLayout, ParallelStrategy):
    """Sharded data parallelism that communicates in ~4 bits (SDP4Bit), for Lightning Fabric.

    One module per strategy (the one `fabric.setup` receives); any number of optimizers over its
    parameters, each fresh. `fabric.backward(loss)` must replace `loss.backward()`.

    The other arguments (`accelerator`, `parallel_devices`, `cluster_environment`,
    `checkpoint_io`, `precision`, `process_group_backend`, `timeout`, `start_method`) are those of
    Fabric's DDPStrategy.

    Args:
        config: an `SDP4BitConfig`, a dict of its fields (optionally with "preset"), or the path
            of a YAML file. Defaults to the paper's settings.
    """

    def __init__(
        self,
        config: SDP4BitConfig | dict[str, Any] | str | os.PathLike | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        self.config = SDP4BitConfig.coerce(config)
        common.check_start_method(start_method)
        common.check_timeout(timeout)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method
        self._backward_sync_control = _EngineBackwardSync(self)
        self.engine: ShardedEngine | None = None
        self._optimizers: list[Optimizer] = []  # in the order they were sharded (the checkpoint's order)
        self._forward_hooks: list[Any] = []
        self.meter = WireMeter()
        self.comm_stats: dict[str, float] = {}
        """The last optimizer step's communication figures (see lightning_sdp4bit.stats)."""

    # ----------------------------------------------------------------------------------------
    # What Fabric asks of a parallel strategy

    @property
    def precision(self) -> Precision:
        return ParallelStrategy.precision.fget(self)  # type: ignore[attr-defined]

    @precision.setter
    def precision(self, precision: Precision | None) -> None:
        # Fabric sets the plugin while it is built, before any process is launched.
        common.check_precision(getattr(precision, "precision", None))
        self._precision = precision

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        common.check_topology(self.config, self.num_nodes, self.num_processes, self.parallel_devices)
        common.check_backend(self._process_group_backend, self.parallel_devices)
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
            _stop_started_ranks_on_uncaught_exception(self._launcher)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    def _set_world_ranks(self) -> None:
        common.set_world_ranks(self)

    def setup_environment(self) -> None:
        super().setup_environment()
        self._set_world_ranks()
        self._process_group_backend = common.connect(
            self.cluster_environment, self._process_group_backend, self._timeout, self.root_device
        )

    # ----------------------------------------------------------------------------------------
    # Model and optimizers

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Build the engine over `module` (already converted to its precision and on its device).
        The module comes back unwrapped: the engine works through hooks."""
        if self.engine is not None:
            raise ValueError(
                "SDP4BitFabricStrategy shards one module and it was set up already; put the modules you "
                "train together into one nn.Module and call fabric.setup once"
            )
        self.engine = common.build_engine(
            module, self.config, self.global_rank, self.world_size, self.num_processes, self.meter, self._timeout
        )
        # Fabric calls the module's own forward, where DDP's wrapper would run its own around it.
        self._forward_hooks = [
            module.register_forward_pre_hook(_AroundForward(self.engine.pre_forward), prepend=True),
            module.register_forward_hook(_AroundForward(self.engine.post_forward)),
        ]
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Re-point a fresh optimizer over the module's parameters at this rank's fp32 master fragments."""
        if self.engine is None:
            raise RuntimeError(
                "set up the module before its optimizers: fabric.setup(model, optimizer), or "
                "fabric.setup_module(model) then fabric.setup_optimizers(optimizer)"
            )
        self.engine.shard_optimizer(optimizer)
        self._optimizers.append(optimizer)
        return optimizer

    def module_to_device(self, module: nn.Module) -> None:
        module.to(self.root_device)

    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        if self.engine is not None:
            self.engine.wait_weights()  # every rank holds the full weights once they have arrived
        return module.state_dict()

    # ----------------------------------------------------------------------------------------
    # The training step

    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        if self.engine is None:
            super().backward(tensor, module, *args, **kwargs)
            return
        self.engine.pre_backward()
        super().backward(tensor, module, *args, **kwargs)
        self.engine.post_backward()

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip by the global 2-norm over every rank's gradient shard (one all-reduce)."""
        if self.engine is None:
            raise RuntimeError("fabric.clip_gradients needs the module set up with fabric.setup first")
        if float(norm_type) != 2.0:
            raise ValueError(f"the sdp4bit strategy clips by the 2-norm only, got norm_type={norm_type!r}")
        self.precision.unscale_gradients(optimizer)
        norm = self.engine.clip_grad_norm(float(max_norm))
        if error_if_nonfinite and not bool(torch.isfinite(norm)):
            raise RuntimeError(
                f"the global gradient norm is {norm.item()}; pass error_if_nonfinite=False to clip anyway"
            )
        return norm

    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        """Clamp the reduced gradients elementwise (the parameters' own .grad are None)."""
        if self.engine is None:
            raise RuntimeError("fabric.clip_gradients needs the module set up with fabric.setup first")
        self.precision.unscale_gradients(optimizer)
        self.engine.clip_grad_value(float(clip_val))

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if self.engine is not None:
            self.engine.pre_optimizer_step()
        output = super().optimizer_step(optimizer, **kwargs)
        if self.engine is not None:
            self.comm_stats = self.engine.post_optimizer_step()
        return output

    def wait_weights(self) -> None:
        """Complete the weight all-gathers that the last optimizer step started.

        A training loop needs nothing: each module's forward waits for its own weights, and any
        other torch operation on a parameter waits for that parameter's bucket (the engine's read
        guard, until the next backward). This completes them all at once.
        """
        if self.engine is not None:
            self.engine.wait_weights()

    def teardown(self) -> None:
        # The engine stays (closed: no hooks, nothing in flight) so that fabric.save afterwards
        # still finds the master shards.
        if self.engine is not None:
            self.engine.close()
        for handle in self._forward_hooks:
            handle.remove()
        self._forward_hooks = []
        super().teardown()

    # ----------------------------------------------------------------------------------------
    # Collectives for users (fabric.all_reduce / broadcast / barrier; all_gather is inherited)

    def all_reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        return common.reduce(tensor, group, reduce_op, common.timeouts_of(self))

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        common.barrier(self.root_device, common.timeouts_of(self))

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return common.broadcast_object(obj, src, common.timeouts_of(self))

    # ----------------------------------------------------------------------------------------
    # Checkpoints: the Trainer's sharded directory (see lightning_sdp4bit.checkpoint)

    def save_checkpoint(
        self,
        path: str | os.PathLike,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Any] | None = None,
    ) -> None:
        """Write `path` as a sharded directory: the module's weights and the optimizers' state go
        into the shards; every other entry (its state_dict if it has one) into meta.pt."""
        if storage_options is not None or filter:
            raise TypeError("the sdp4bit strategy writes sharded directories and takes no storage_options or filter")
        if self.engine is None:
            raise RuntimeError("fabric.save needs the module set up with fabric.setup first")
        module_key, optimizer_keys, extras = None, [], {}
        for key, obj in state.items():
            if obj is self.engine.module:
                module_key = key
            elif any(obj is optimizer for optimizer in self._optimizers):
                optimizer_keys.append(key)
            else:
                extras[key] = obj.state_dict() if isinstance(obj, _Stateful) else obj
        extras[common.SAVED_BY_FABRIC] = {"module": module_key, "optimizers": optimizer_keys}
        common.save_sharded(self.engine, self._optimizers, extras, path, self.barrier)

    def load_checkpoint(
        self,
        path: str | os.PathLike,
        state: dict[str, Any] | nn.Module | Optimizer | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore the set-up module and its optimizers from a sharded directory (written by Fabric
        or the Trainer) or from an ordinary file (consolidated, or DDP's); other entries of `state`
        from the checkpoint's other entries. Returns what `state` did not ask for."""
        path = sharded_checkpoint.find_checkpoint(path)  # a save interrupted before its last rename
        if state is not None and not isinstance(state, dict):
            raise TypeError(
                "the sdp4bit strategy loads into a dict of objects, e.g. fabric.load(path, {'model': model, "
                "'optimizer': optimizer}); got " + type(state).__name__
            )
        if not state:
            if sharded_checkpoint.is_sharded_checkpoint(path):
                return sharded_checkpoint.consolidate_checkpoint(path, weights_only=weights_only)
            return self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        if self.engine is None:
            raise RuntimeError("fabric.load needs the module set up with fabric.setup first")
        module_keys = [k for k, obj in state.items() if obj is self.engine.module]
        optimizer_keys = [k for k, obj in state.items() if any(obj is o for o in self._optimizers)]
        if optimizer_keys and not module_keys:
            raise ValueError(
                f"{path}: the optimizers' sharded state belongs with the module's; load both, e.g. "
                "fabric.load(path, {'model': model, 'optimizer': optimizer})"
            )
        if optimizer_keys and len(optimizer_keys) != len(self._optimizers):
            raise ValueError(f"{path}: pass all {len(self._optimizers)} set-up optimizers or none")
        optimizers = self._optimizers if optimizer_keys else None
        if sharded_checkpoint.is_sharded_checkpoint(path):
            remainder = self._load_sharded(path, module_keys, optimizers, weights_only)
        else:
            remainder = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
            _validate_keys_for_strict_loading(module_keys + optimizer_keys, remainder.keys(), strict=strict)
            if module_keys and module_keys[0] in remainder:
                saved = [remainder.pop(k) for k in optimizer_keys if k in remainder]
                module_state = remainder.pop(module_keys[0])
                sharded_checkpoint.check_state_dict(self.engine.module, module_state, strict)
                common.load_ordinary_state(self.engine, optimizers if saved else None, module_state, saved)
        others = [k for k in state if k not in module_keys and k not in optimizer_keys]
        _validate_keys_for_strict_loading(others, remainder.keys(), strict=strict)
        for key in others:
            if key not in remainder:
                continue
            if isinstance(state[key], _Stateful):
                state[key].load_state_dict(remainder.pop(key))
            else:
                state[key] = remainder.pop(key)
        return remainder

    def _load_sharded(
        self, path: Any, module_keys: list[str], optimizers: list[Optimizer] | None, weights_only: bool | None
    ) -> dict[str, Any]:
        """`weights_only`: Fabric's argument, for meta.pt (the shards are always read with True)."""
        assert self.engine is not None
        if module_keys:
            self.engine.wait_weights()
            # meta.pt of the generation whose shards were loaded.
            meta = sharded_checkpoint.load_sharded(self.engine, optimizers, path, weights_only=weights_only)
            self.engine.module.load_state_dict(meta["untrained_state"], strict=False)
            self.engine.weights_loaded()  # a tied weight's second name wrote the loaded value again
        else:
            meta = sharded_checkpoint.read_meta(
                path, collective=True, timeouts=common.timeouts_of(self), weights_only=weights_only
            )
        remainder = dict(meta["lightning"])
        remainder.pop(common.SAVED_BY_FABRIC, None)
        return remainder


class _EngineBackwardSync(_BackwardSyncControl):
    """`fabric.no_backward_sync(model)`: the micro-batch's gradients accumulate, nothing is sent."""

    def __init__(self, strategy: SDP4BitFabricStrategy):
        self._strategy = strategy

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        engine = self._strategy.engine
        if not enabled:
            return nullcontext()
        if engine is None or module is not engine.module:
            raise TypeError("no_backward_sync takes the model that fabric.setup returned for this strategy")
        return engine.no_sync()


class _AroundForward:
    """A forward (pre-)hook of the set-up module that calls one step-protocol call. A deep copy of
    the module (an EMA or SWA average) is no replica: its copy of the hook does nothing."""

    def __init__(self, call: Callable[[], None]):
        self._call = call

    def __call__(self, module: nn.Module, *args: Any) -> None:
        self._call()

    def __deepcopy__(self, memo: dict) -> _AroundForward:
        return _AroundForward(lambda: None)


def _stop_started_ranks_on_uncaught_exception(launcher: _SubprocessScriptLauncher) -> None:
    """When the launcher's own process dies of an exception (a peer stalled past the timeout),
    SIGKILL the ranks it started, as the Trainer adapter's on_exception does: Lightning stops
    them only when one of them fails, and a stalled one would outlive the job. Fabric has no
    exception hook of its own, so this one is the interpreter's."""
    previous = sys.excepthook

    def stop_then_report(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        for process in launcher.procs:  # empty in the started ranks themselves
            process.send_signal(signal.SIGKILL)
        previous(kind, value, traceback)

    sys.excepthook = stop_then_report
