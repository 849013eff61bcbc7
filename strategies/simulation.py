"""`SDP4BitSimulationStrategy`: a job of M x L ranks trained on one device through the Trainer.

    trainer = pl.Trainer(strategy=SDP4BitSimulationStrategy("16x4", config={"preset": "sdp4bit"}),
                         devices=1, precision="bf16-true", enable_checkpointing=False)
    trainer.fit(module)   # your LightningModule, as a 64-rank job would train it

Each Lightning step runs every simulated rank's step on `lightning_sdp4bit.simulation`'s engine,
through the same step protocol as `SDP4BitStrategy`: rank r's micro-batch is what Lightning's
DistributedSampler(num_replicas=W, rank=r) gives it (Lightning injects rank 0's sampler, this
strategy builds the others from it), and its turn (`running_as`) gives it its own RNG stream and
module buffers, as a process of its own would have. Ranks 1..W-1 run first, rank 0 last, so that
what `self.log` reports per step is rank 0's, as in a real job; epoch-level means cover every
rank. Validation runs every rank's share too, so a torchmetrics metric or an epoch mean covers
the whole validation set, as one synced over a real job's ranks does. During rank r's turn
`trainer.global_rank` is r and `trainer.world_size` is W, as in rank r's process
(`trainer.local_rank` and `node_rank` stay 0: one process on one device).

Not supported (refused before any step, with a message): manual optimization, several
optimizers, hooks that read gradients (`on_before_optimizer_step` overridden), sync_batchnorm,
checkpoints (the W ranks' optimizer states live in this process only: pass
enable_checkpointing=False), more than one device, more than one train dataloader, custom
samplers or batch samplers, and `trainer.test`/`predict` (use the fitted module with another
strategy).
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NoReturn

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from lightning_sdp4bit.config import SDP4BitConfig
from lightning_sdp4bit.simulation import SimulatedEngine, check_shape, parse_world
from lightning_sdp4bit.strategies import common
from lightning_sdp4bit.strategies.hooks import WeightReadingHooks, overrides_hook

__all__ = ["SDP4BitSimulationStrategy"]

# Lightning's own words for a skipped step in a job of several ranks (loops/optimization/automatic.py).
_NONE_STEP = (
    "Skipping the `training_step` by returning None in distributed training is not supported. It is "
    "recommended that you rewrite your training logic to avoid having to skip the step in the first place."
)


def _refuse(what: str) -> NoReturn:
    raise ValueError(f"SDP4BitSimulationStrategy: {what}")


class _RankLoaders:
    """Ranks 1..W-1's copies of one DataLoader that Lightning gave rank 0's DistributedSampler.
    Each rank's iterator is made in that rank's turn (its base seed is drawn from the rank's own
    generator, as in its process), whenever rank 0's starts over, at the loop's epoch."""

    def __init__(self, loader: Any, world: int, transfer, stage: str):
        if not isinstance(loader, DataLoader):
            _refuse(f"the {stage} dataloader is a {type(loader).__name__}; the simulation supports a DataLoader")
        sampler = loader.sampler
        if type(sampler) is not DistributedSampler or type(loader.batch_sampler) is not BatchSampler:
            _refuse(
                f"the {stage} dataloader's sampler is {type(sampler).__name__} with a "
                f"{type(loader.batch_sampler).__name__}; the simulation supports the samplers Lightning replaces by "
                "DistributedSampler (a DataLoader with shuffle=True or False and no custom sampler or batch_sampler)"
            )
        assert isinstance(sampler, DistributedSampler)  # checked above
        self._transfer, self._sampler0 = transfer, sampler
        self._samplers: dict[int, DistributedSampler] = {
            rank: DistributedSampler(
                sampler.dataset, world, rank, shuffle=sampler.shuffle, seed=sampler.seed, drop_last=sampler.drop_last
            )
            for rank in range(1, world)
        }
        self._loaders = {
            rank: DataLoader(
                loader.dataset,
                batch_size=loader.batch_size,
                sampler=rank_sampler,
                num_workers=loader.num_workers,
                collate_fn=loader.collate_fn,
                pin_memory=loader.pin_memory,
                drop_last=loader.drop_last,
            )
            for rank, rank_sampler in self._samplers.items()
        }
        self._iterators: dict[int, Iterator] = {}

    def next_batch(self, rank: int, restart: bool) -> Any:
        """Rank `rank`'s next batch, on the device; `restart` at rank 0's batch 0."""
        if restart or rank not in self._iterators:
            self._samplers[rank].set_epoch(self._sampler0.epoch)  # what the loop set on rank 0's
            self._iterators[rank] = iter(self._loaders[rank])
        return self._transfer(next(self._iterators[rank]))


class SDP4BitSimulationStrategy(common.DataParallelLayout, ParallelStrategy):
    """Train as a job of `world` = "MxL" ranks (M nodes of L) would, on one device.

    Args:
        world: "MxL" or (M, L), whole numbers, at least 2 ranks.
        config: as for `SDP4BitStrategy`: an `SDP4BitConfig`, a dict (optionally with "preset") or
            a YAML path. `world` gives the shape: a `ranks_per_node` other than L is refused.
        **kwargs: `accelerator`, `parallel_devices`, `checkpoint_io`, `precision_plugin`, as for
            Lightning's strategies.
    """

    strategy_name = "sdp4bit_simulation"

    def __init__(self, world: str | tuple[int, int] = "2x2", config: Any = None, **kwargs: Any) -> None:
        self.nodes, self.local = parse_world(world)
        self.config = SDP4BitConfig.coerce(config)
        check_shape(self.config, self.nodes, self.local)
        super().__init__(**kwargs)
        self._num_nodes, self._process_group_backend = 1, None
        self.engine: SimulatedEngine | None = None
        self.comm_stats: dict[str, float] = {}
        self._loaders: dict[tuple[str, int], _RankLoaders] = {}
        self._turn_rank = 0  # the simulated rank whose step runs now
        self._weight_hooks: WeightReadingHooks | None = None

    @property
    def simulated_world_size(self) -> int:
        return self.nodes * self.local

    @property
    def world_size(self) -> int:
        return self.simulated_world_size  # what every process of the job reports

    @property
    def global_rank(self) -> int:  # type: ignore[override]  # Lightning's is settable; this one follows the turn
        return self._turn_rank  # rank r during its turn; rank 0 (this process) otherwise

    @property
    def is_distributed(self) -> bool:
        return True  # so that Lightning injects DistributedSampler(num_replicas=W, rank=0)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": self.simulated_world_size, "rank": 0}

    def _configure_launcher(self) -> None:
        self._launcher = None  # one process

    def setup_environment(self) -> None:
        if len(self.parallel_devices or []) != 1:
            _refuse(f"runs on one device; the Trainer gave it {len(self.parallel_devices or [])} (set devices=1)")
        assert self.accelerator is not None
        self.accelerator.setup_device(self.root_device)
        reset_seed()  # as each process of a real job does when it sets up its environment

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        # Lightning restores a ckpt_path before the strategy's setup: refused here, before any step.
        _refuse(
            f"resuming from ckpt_path={str(checkpoint_path)!r} is not supported: a simulated job reads and writes "
            "no checkpoints (every rank's optimizer state lives in this process); fit without ckpt_path"
        )

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def set_world_ranks(self) -> None:
        """One process: the simulated ranks live inside it (`global_rank`, `world_size`)."""

    def setup(self, trainer: pl.Trainer) -> None:
        module = trainer.lightning_module
        if trainer.state.fn != TrainerFn.FITTING:
            _refuse(f"trainer.{trainer.state.fn}() is not supported; use the fitted module with another strategy")
        self._check_supported(trainer, module)
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        engine = self.engine = SimulatedEngine(module, self.config, self.nodes, self.local)
        self.setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            _refuse(f"configure_optimizers returned {len(self.optimizers)} optimizers; the simulation supports one")
        engine.shard_optimizer(self.optimizers[0])
        common.rewire_lightning_optimizers(self._lightning_optimizers)
        self.setup_precision_plugin()
        _optimizers_to_device(self.optimizers, self.root_device)
        plugin = self.precision_plugin
        common.clip_through(plugin, engine)
        plugin._after_closure = self._after_closure  # type: ignore[method-assign]
        self._weight_hooks = WeightReadingHooks(engine.wait_weights, engine.tracking_weight_writes)
        self._weight_hooks.install(trainer, module)
        engine.share_rng_state()  # every process's set-up ends here, with the same draws as this one's

    def _check_supported(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if not module.automatic_optimization:
            _refuse("manual optimization is not supported; use automatic optimization")
        readers = [
            type(o).__name__
            for o in [*common.callbacks_of(trainer), module]
            if overrides_hook(o, "on_before_optimizer_step")
        ]
        if readers:
            _refuse(f"{readers} override on_before_optimizer_step; hooks that read gradients are not supported")
        if any(isinstance(c, ModelCheckpoint) for c in common.callbacks_of(trainer)):
            _refuse(
                "writes no checkpoints (every rank's optimizer state lives in this process): "
                "pass enable_checkpointing=False"
            )
        if self._layer_sync is not None:
            _refuse("sync_batchnorm=True is not supported (every rank's batch statistics would be needed at once)")
        common.refuse_finetuning_callbacks(trainer)
        common.check_precision(getattr(self.precision_plugin, "precision", None))

    def _trainer(self) -> pl.Trainer:
        module = self.lightning_module
        assert module is not None  # set before setup
        return module.trainer

    def on_train_start(self) -> None:
        """The train dataloader exists now: refuse what the simulation cannot split, before any step."""
        loaders = self._trainer().train_dataloader
        if isinstance(loaders, (Mapping, list, tuple)):
            if len(loaders) != 1:
                _refuse(f"got {len(loaders)} train dataloaders; the simulation supports one")
            loaders = next(iter(loaders.values())) if isinstance(loaders, Mapping) else loaders[0]
        self._loaders[("train", 0)] = _RankLoaders(loaders, self.simulated_world_size, self.batch_to_device, "train")

    def on_validation_start(self) -> None:
        loaders = self._trainer().val_dataloaders
        for index, loader in enumerate(loaders if isinstance(loaders, (list, tuple)) else [loaders]):
            self._loaders[("val", index)] = _RankLoaders(
                loader, self.simulated_world_size, self.batch_to_device, "validation"
            )

    # ----------------------------------------------------------------------------------------
    # The step of every rank

    @contextmanager
    def _turn(self, rank: int) -> Generator[None, None, None]:
        """Rank `rank`'s step: the engine runs as it (its gradients, RNG stream and buffers), and
        the Trainer and `rank_zero_only` see it as the process's rank."""
        assert self.engine is not None
        self._turn_rank = rank
        common.set_rank_zero_only(rank)
        try:
            with self.engine.running_as(rank):
                yield
        finally:
            self._turn_rank = 0
            common.set_rank_zero_only(0)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.engine is not None
        engine, trainer, batch_idx = self.engine, self._trainer(), args[1]
        accumulate = trainer.accumulate_grad_batches  # Lightning divides each loss by it
        engine.pre_forward()
        for rank in range(1, self.simulated_world_size):
            with self._turn(rank):
                batch = self._loaders[("train", 0)].next_batch(rank, restart=batch_idx == 0)
                output = super().training_step(batch, *args[1:], **kwargs)
                loss = output["loss"] if isinstance(output, Mapping) else output
                if loss is None:
                    raise RuntimeError(_NONE_STEP)
                if batch_idx % accumulate == 0:
                    engine.zero_grad()  # where Lightning zeroes rank 0's: after its forward, before its backward
                engine.pre_backward()
                (loss / accumulate).backward()
                engine.receive_grads()
        output = super().training_step(*args, **kwargs)
        engine.post_forward()
        return output

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        assert self.engine is not None
        self.engine.pre_backward()

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        assert self.engine is not None
        self.engine.receive_grads()  # rank 0's
        self.engine.post_backward()

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Non-final micro-batches of gradient accumulation: the windows add up in fp32."""
        assert self.engine is not None
        with self.engine.no_sync():
            yield

    def _after_closure(self, model: pl.LightningModule, optimizer: Any) -> None:
        assert self.engine is not None
        trainer = model.trainer
        self.precision_plugin._clip_gradients(
            model, optimizer, trainer.gradient_clip_val, gradient_clip_algorithm=trainer.gradient_clip_algorithm
        )
        self.engine.pre_optimizer_step()

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        assert self.engine is not None
        output = super().optimizer_step(optimizer, closure, model, **kwargs)  # rank 0's optimizer
        self.comm_stats = self.engine.post_optimizer_step()  # and then every other rank's
        return output

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.engine is not None
        batch_idx = args[1]
        index = args[2] if len(args) > 2 else kwargs.get("dataloader_idx", 0)
        self.engine.pre_forward()
        for rank in range(1, self.simulated_world_size):
            with self._turn(rank):
                batch = self._loaders[("val", index)].next_batch(rank, restart=batch_idx == 0)
                super().validation_step(batch, *args[1:], **kwargs)
        output = super().validation_step(*args, **kwargs)
        self.engine.post_forward()
        return output

    def teardown(self) -> None:
        if self._weight_hooks is not None:
            self._weight_hooks.remove()
            self._weight_hooks = None
        if self.engine is not None:
            self.engine.close()
        super().teardown()

    # ----------------------------------------------------------------------------------------
    # One process: collectives are the identity

    def barrier(self, name: str | None = None) -> None:
        """Nothing to wait for."""

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return tensor

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision  # one decision, taken once for every rank (by rank 0's callbacks)

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return tensor.unsqueeze(0)
