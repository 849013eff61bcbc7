"""`SDP4BitStrategy`: the Lightning adapter over `lightning_sdp4bit.engine.ShardedEngine`.

It does what only Lightning can: launch processes, pick the precision, drive the engine from
the training loop's hooks (backward sync, optimizer step, validation, end of fit) and map
checkpoints to `lightning_sdp4bit.checkpoint`. Everything else lives below, testable without a
Trainer.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.connectors.signal_connector import _get_sigkill_signal
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor

from lightning_sdp4bit.config import SDP4BitConfig
from lightning_sdp4bit.engine import ShardedEngine
from lightning_sdp4bit.materialize import is_on_meta
from lightning_sdp4bit.stats import WireMeter
from lightning_sdp4bit.strategies import common, launchers, peers
from lightning_sdp4bit.strategies.comm_logging import CommStatsLogger
from lightning_sdp4bit.strategies.common import SUPPORTED_PRECISIONS
from lightning_sdp4bit.strategies.hooks import WeightReadingHooks, overrides_hook
from lightning_sdp4bit.strategies.preemption import PreemptionSignal
from lightning_sdp4bit.strategies.trainer_checkpoints import ShardedCheckpoints

__all__ = ["SUPPORTED_PRECISIONS", "SDP4BitStrategy"]

log = logging.getLogger(__name__)


class SDP4BitStrategy(common.DataParallelLayout, ShardedCheckpoints, ParallelStrategy):
    """Sharded data parallelism that communicates in ~4 bits (SDP4Bit, NeurIPS 2024).

    Every rank keeps the full weights in the module's dtype; each rank keeps fp32 master weights
    and optimizer state for its 1/world slice only. Gradients are reduce-scattered (by default
    with TLq-HS: int8 inside a node, int4 across nodes, after a Hadamard rotation) and updated
    weights all-gathered (by default with qWD: 4-bit weight differences).

    The other arguments (`accelerator`, `parallel_devices`, `cluster_environment`,
    `checkpoint_io`, `precision_plugin`, `process_group_backend`, `timeout`, `start_method`) are
    those of Lightning's DDPStrategy.

    Args:
        config: an `SDP4BitConfig`, a dict of its fields (optionally with "preset"), or the path
            of a YAML file. Defaults to the paper's settings.
    """

    strategy_name = "sdp4bit"

    def __init__(
        self,
        config: SDP4BitConfig | dict[str, Any] | str | os.PathLike | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
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
            precision_plugin=precision_plugin,
        )
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method
        self.engine: ShardedEngine | None = None
        self._weight_hooks: WeightReadingHooks | None = None
        self._preemption: PreemptionSignal | None = None
        self.meter = WireMeter()
        self.comm_stats: dict[str, float] = {}
        """The last optimizer step's communication figures (see lightning_sdp4bit.stats)."""

    # ----------------------------------------------------------------------------------------
    # What Lightning asks of a parallel strategy

    @property
    def is_distributed(self) -> bool:
        # Lightning injects the DistributedSampler and honours sync_dist only when this is True.
        return True

    @property
    def precision_plugin(self) -> Precision:
        return ParallelStrategy.precision_plugin.fget(self)  # type: ignore[attr-defined]

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning sets the plugin while building the Trainer, before any process is spawned.
        common.check_precision(getattr(plugin, "precision", None))
        self._precision_plugin = plugin

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # The engine (and its layout) must exist before a sharded checkpoint can be restored.
        return True

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        common.check_topology(self.config, self.num_nodes, self.num_processes, self.parallel_devices)
        common.check_backend(self._process_group_backend, self.parallel_devices)
        # Lightning's launchers, finishing interrupted first saves before "last" is looked for.
        if self._start_method == "popen":
            self._launcher = launchers.SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
        else:
            self._launcher = launchers.MultiProcessingLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = common.connect(
            self.cluster_environment, self._process_group_backend, self._timeout, self.root_device
        )
        # Every rank's address, so that a connection error names the lost peer (on_exception).
        self._peer_addresses = peers.gather_addresses(common.timeouts_of(self)) if self.world_size > 1 else []

    def set_world_ranks(self) -> None:
        common.set_world_ranks(self)

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self._preemption = PreemptionSignal(trainer, self._timeout)
        if trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
            # Trainer(sync_batchnorm=True), as DDPStrategy: SyncBatchNorm for the fit, reverted
            # at teardown. The converted modules keep the same Parameter objects.
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        common.check_sync_batchnorm_device(self.model, self.root_device)
        self.engine = None
        if trainer.state.fn == TrainerFn.FITTING:
            common.refuse_finetuning_callbacks(trainer)
            if self.config.shards_weights and getattr(trainer.lightning_module, "_compiler_ctx", None):
                raise ValueError(
                    "sdp4bit: weight_sharding='node' does not run under torch.compile yet (its gathers swap the "
                    "parameters' storage between forwards): fit the module uncompiled, or with "
                    "weight_sharding='replicated'"
                )
            # Manual optimization: no backward is known to be the window's last, so nothing is
            # sent during backward; the gradients are reduced when opt.step() (or a clip) needs them.
            self.engine = common.build_engine(
                self.model,
                self.config,
                self.global_rank,
                self.world_size,
                self.num_processes,
                self.meter,
                self._timeout,
                manual=not trainer.lightning_module.automatic_optimization,
                device=self.root_device,
            )
            self.setup_optimizers(trainer)
            for optimizer in self.optimizers:
                self.engine.shard_optimizer(optimizer)
            common.rewire_lightning_optimizers(self._lightning_optimizers)
            self._weight_hooks = WeightReadingHooks(self._wait_weights, self.engine.tracking_weight_writes)
            self._weight_hooks.install(trainer, trainer.lightning_module)
        else:
            _sync_module_states(self.model)
        self.setup_precision_plugin()
        if self.engine is not None:
            _optimizers_to_device(self.optimizers, self.root_device)
            plugin = self.precision_plugin
            common.clip_through(plugin, self.engine)
            plugin._after_closure = self._after_closure  # type: ignore[method-assign]
            callbacks = common.callbacks_of(trainer)
            if self.config.log_comm_stats and not any(isinstance(c, CommStatsLogger) for c in callbacks):
                callbacks.append(CommStatsLogger())

    def model_to_device(self) -> None:
        assert self.model is not None
        module = self.lightning_module
        if not is_on_meta(self.model):
            self.model.to(self.root_device)
        elif not (self.config.shards_weights and module is not None and module.trainer.state.fn == TrainerFn.FITTING):
            raise ValueError(
                "sdp4bit: the module has parameters on the meta device (configure_model, or "
                "trainer.init_module(empty_init=True)); only fit with weight_sharding='node' materializes it, each "
                "rank what it holds. Otherwise build it on a device, or load a checkpoint into a real module."
            )

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """trainer.init_module(empty_init=True) under weight_sharding="node": on the meta device,
        so that no rank ever holds the whole model; fit materializes each rank's node slices."""
        if empty_init and self.config.shards_weights:
            with torch.device("meta"), self.precision_plugin.tensor_init_context():
                yield
        else:
            with super().tensor_init_context(empty_init):
                yield

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """configure_model under weight_sharding="node" builds on the meta device (as above)."""
        with torch.device("meta") if self.config.shards_weights else nullcontext():
            yield

    def _after_closure(self, model: pl.LightningModule, optimizer: Any) -> None:
        """Precision._after_closure, with the engine's steps around the hooks: between backward
        and the optimizer's update, in automatic and manual optimization alike.

        on_before_optimizer_step sees the full reduced gradients on the parameters (an fp32
        all-gather) only if a callback or the module overrides it; their edits to p.grad reach the
        shards. Clipping then works on the shards, and in-place weight edits made in any hook
        since the last step reach the fp32 masters before the optimizer steps them.
        """
        assert self.engine is not None
        trainer = model.trainer
        readers = [
            obj for obj in [*common.callbacks_of(trainer), model] if overrides_hook(obj, "on_before_optimizer_step")
        ]
        with self.engine.reduced_gradients() if readers else nullcontext():
            call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
            call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)
        self.precision_plugin._clip_gradients(
            model, optimizer, trainer.gradient_clip_val, gradient_clip_algorithm=trainer.gradient_clip_algorithm
        )
        self.engine.pre_optimizer_step()

    # ----------------------------------------------------------------------------------------
    # The training loop

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Non-final micro-batches of gradient accumulation: accumulate, send nothing."""
        with self.engine.no_sync() if self.engine is not None else nullcontext():
            yield

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(super().training_step, *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(super().validation_step, *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(super().test_step, *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(super().predict_step, *args, **kwargs)

    def _forward(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One step is one forward of DDP's wrapper: the buffers follow its broadcast_buffers
        schedule around it (lightning_sdp4bit.buffer_sync). Outside fit (no engine) DDPStrategy
        wraps nothing either: the buffers were synced once at setup, as there."""
        if self.engine is None:
            return step(*args, **kwargs)
        self.engine.pre_forward()
        output = step(*args, **kwargs)
        self.engine.post_forward()
        return output

    def pre_backward(self, closure_loss: Tensor) -> None:
        if self.engine is not None:
            self.engine.pre_backward()

    def post_backward(self, closure_loss: Tensor) -> None:
        if self.engine is not None:
            self.engine.post_backward()

    def optimizer_step(
        self,
        optimizer: Any,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.engine is not None:
            self.comm_stats = self.engine.post_optimizer_step()
        return output

    def _wait_weights(self) -> None:
        if self.engine is not None:
            self.engine.wait_weights()

    def on_validation_start(self) -> None:
        self._wait_weights()

    def on_test_start(self) -> None:
        self._wait_weights()

    def on_predict_start(self) -> None:
        self._wait_weights()

    def on_train_end(self) -> None:
        self._wait_weights()

    def on_exception(self, exception: BaseException) -> None:
        note = peers.lost_peer_note(exception, getattr(self, "_peer_addresses", []), self.global_rank)
        if note and exception.args:
            exception.args = (f"{exception.args[0]}\n{note}", *exception.args[1:])
        # Lightning's popen launcher stops the ranks it started only on Ctrl-C: when this one
        # fails (a peer stalled past the timeout), a stalled rank would outlive the job, orphaned.
        # Not on a preemption: every rank raises SIGTERMException at the same batch and exits by
        # itself, after its on_exception callbacks (a checkpoint) have run.
        launcher = self._launcher
        stopping_together = isinstance(exception, SIGTERMException)
        if isinstance(launcher, _SubprocessScriptLauncher) and launcher.procs and not stopping_together:
            launcher.kill(_get_sigkill_signal())

    def teardown(self) -> None:
        # The engine stays (closed: no hooks, nothing in flight) so that trainer.save_checkpoint
        # after fit still finds the master shards; the next fit builds a new one.
        if self.engine is not None:
            self.engine.close()
        if self._weight_hooks is not None:
            self._weight_hooks.remove()
            self._weight_hooks = None
        if self._preemption is not None:
            self._preemption.close()
            self._preemption = None
        module = self.lightning_module
        if module is not None and module._trainer is not None and module._trainer.state.fn == TrainerFn.FITTING:
            if self._layer_sync and self.model is not None:
                self.model = self._layer_sync.revert(self.model)
        super().teardown()

    # ----------------------------------------------------------------------------------------
    # Collectives for users (self.log(sync_dist=True), self.all_gather, ...)

    def barrier(self, name: str | None = None) -> None:
        common.barrier(self.root_device, common.timeouts_of(self))

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return common.broadcast_object(obj, src, common.timeouts_of(self))

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        return common.reduce(tensor, group, reduce_op, common.timeouts_of(self))


# Lightning's Trainer accepts a compiled LightningModule (trainer.fit(torch.compile(module))) only
# under the strategies its compile check lists by isinstance: SingleDevice, DDP, FSDP. This one is
# DDP's kind (full weights on every rank, gradients reduced in backward) and is compile-safe (see
# module_hooks.CompiledRegionWatch), so it registers as a virtual subclass of DDPStrategy. It inherits
# nothing from DDPStrategy; within Lightning 2.6 only that check and `is_distributed` ask.
DDPStrategy.register(SDP4BitStrategy)
