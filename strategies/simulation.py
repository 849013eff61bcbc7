"""`SDP4BitSimulationStrategy`: a job of M x L ranks trained on one device through the Trainer.

    trainer = pl.Trainer(strategy=SDP4BitSimulationStrategy("16x4", config={"preset": "sdp4bit"}),
                         devices=1, precision="bf16-true", enable_checkpointing=False)
    trainer.fit(module)   # your LightningModule, as a 64-rank job would train it

Each Lightning step runs every simulated rank's step (`lightning_sdp4bit.simulation.engine`): rank
r's micro-batch is what Lightning's DistributedSampler(num_replicas=W, rank=r) gives it (Lightning
injects rank 0's sampler, this strategy builds the others from it), its forward and backward run
with its own RNG state (as each process's own generator would), and its gradients go into its own
window. Ranks 1..W-1 run first, rank 0 last, so that what `self.log` reports per step is rank 0's,
as in a real job; epoch-level means cover every rank. Validation runs every rank's share too, so
a torchmetrics metric or an epoch mean covers the whole validation set, as one synced over a real
job's ranks does.

Not supported (refused at setup, with a message): manual optimization, several optimizers,
clipping by value, sync_batchnorm, hooks that read gradients (`on_before_optimizer_step` overridden), checkpoints
(the W ranks' optimizer states live in this process only: pass enable_checkpointing=False), more
than one device, custom samplers or batch samplers, and `trainer.test`/`predict` (validate the
fitted module with another strategy).
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning_sdp4bit.strategies import common
from lightning_sdp4bit.strategies.hooks import overrides_hook
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from lightning_sdp4bit.config import SDP4BitConfig
from lightning_sdp4bit.simulation import SimulatedEngine, check_shape, parse_world

__all__ = ["SDP4BitSimulationStrategy"]


def _refuse(what: str) -> None:
    raise ValueError(f"SDP4BitSimulationStrategy: {what}")


class _RankLoaders:
    """Ranks 1..W-1's copies of one DataLoader that Lightning gave rank 0's DistributedSampler,
    iterated in step with it (restarted, at the loop's epoch, whenever rank 0's starts over)."""

    def __init__(self, loader: DataLoader, world: int, transfer):
        if not isinstance(loader, DataLoader):
            _refuse(f"got a {type(loader).__name__} of dataloaders; the simulation supports one DataLoader per stage")
        sampler = loader.sampler
        if type(sampler) is not DistributedSampler or type(loader.batch_sampler) is not BatchSampler:
            _refuse(
                f"the dataloader's sampler is {type(sampler).__name__} with a {type(loader.batch_sampler).__name__}; "
                "the simulation supports the samplers Lightning replaces by DistributedSampler (a DataLoader with "
                "shuffle=True or False and no custom sampler or batch_sampler)"
            )
        self._transfer = transfer
        self._loaders = [
            DataLoader(
                loader.dataset,
                batch_size=loader.batch_size,
                sampler=DistributedSampler(
                    sampler.dataset,
                    world,
                    rank,
                    shuffle=sampler.shuffle,
                    seed=sampler.seed,
                    drop_last=sampler.drop_last,
                ),
                num_workers=loader.num_workers,
                collate_fn=loader.collate_fn,
                pin_memory=loader.pin_memory,
                drop_last=loader.drop_last,
            )
            for rank in range(1, world)
        ]
        self._iterators: list[Iterator] = []
        self._sampler0 = sampler

    def next_batches(self, restart: bool) -> list[Any]:
        """Ranks 1..W-1's next batches, on the device; `restart` at rank 0's batch 0."""
        if restart or not self._iterators:
            for loader in self._loaders:
                loader.sampler.set_epoch(self._sampler0.epoch)  # what the loop set on rank 0's
            self._iterators = [iter(loader) for loader in self._loaders]
        return [self._transfer(next(iterator)) for iterator in self._iterators]


class SDP4BitSimulationStrategy(common.DataParallelLayout, ParallelStrategy):
    """Train as a job of `world` = "MxL" ranks (M nodes of L) would, on one device.

    Args:
        world: "MxL" or (M, L), at least 2 ranks.
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
        self._rng: list[Any] = []  # per simulated rank
        self._buffers: list[list[torch.Tensor]] = []  # per simulated rank: its module buffers
        self._accumulating = False

    @property
    def simulated_world_size(self) -> int:
        return self.nodes * self.local

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
        self.accelerator.setup_device(self.root_device)

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
        """One process: rank 0 of 1 (the simulated ranks live inside it)."""

    def setup(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        if trainer.state.fn != TrainerFn.FITTING:
            _refuse(f"trainer.{trainer.state.fn.value}() is not supported; use the fitted module with another strategy")
        self._check_supported(trainer, module)
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.engine = SimulatedEngine(module, self.config, self.nodes, self.local)
        self.setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            _refuse(f"configure_optimizers returned {len(self.optimizers)} optimizers; the simulation supports one")
        self.engine.shard_optimizer(self.optimizers[0])
        self.setup_precision_plugin()
        _optimizers_to_device(self.optimizers, self.root_device)
        plugin = self.precision_plugin
        plugin.clip_grad_by_norm = lambda optimizer, clip_val: self.engine.clip_grad_norm(float(clip_val))
        plugin._after_closure = self._after_closure
        self._rng = [_rng_state(self.root_device)] * self.simulated_world_size  # as seed_everything leaves every rank
        self._buffers = [[b.detach().clone() for b in module.buffers()]] * self.simulated_world_size

    def _check_supported(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if not module.automatic_optimization:
            _refuse("manual optimization is not supported; use automatic optimization")
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm == "value":
            _refuse("gradient_clip_algorithm='value' is not supported; clip by norm")
        readers = [
            type(o).__name__ for o in [*trainer.callbacks, module] if overrides_hook(o, "on_before_optimizer_step")
        ]
        if readers:
            _refuse(f"{readers} override on_before_optimizer_step; hooks that read gradients are not supported")
        if any(isinstance(c, ModelCheckpoint) for c in trainer.callbacks):
            _refuse(
                "writes no checkpoints (every rank's optimizer state lives in this process): "
                "pass enable_checkpointing=False"
            )
        if self._layer_sync is not None:
            _refuse("sync_batchnorm=True is not supported (every rank's batch statistics would be needed at once)")
        common.check_precision(getattr(self.precision_plugin, "precision", None))

    # ----------------------------------------------------------------------------------------
    # The step of every rank

    @contextmanager
    def _as_rank(self, rank: int) -> Generator[None, None, None]:
        """Run with rank `rank`'s RNG state (its own dropout masks) and module buffers, both kept
        for its next step. With `broadcast_buffers` (DDP's default) every rank's buffers are rank
        0's at the start of a step, as DDP broadcasts them before each forward: rank 0 runs last,
        so the module holds its buffers between steps."""
        _set_rng_state(self._rng[rank], self.root_device)
        buffers = list(self.lightning_module.buffers())
        with torch.no_grad():
            for mine, kept in zip(buffers, self._buffers[rank], strict=True):
                mine.copy_(kept)
        try:
            yield
        finally:
            self._rng[rank] = _rng_state(self.root_device)
            self._buffers[rank] = [b.detach().clone() for b in buffers]

    def _start_step(self) -> None:
        if self.config.broadcast_buffers:
            rank0 = [b.detach().clone() for b in self.lightning_module.buffers()]
            self._buffers = [rank0] * self.simulated_world_size

    def _others(self, kind: str, index: int, batch_idx: int) -> list[Any]:
        trainer = self.lightning_module.trainer
        if (kind, index) not in self._loaders:
            loaders = trainer.train_dataloader if kind == "train" else trainer.val_dataloaders
            loader = loaders[index] if isinstance(loaders, (list, tuple)) else loaders
            self._loaders[(kind, index)] = _RankLoaders(loader, self.simulated_world_size, self.batch_to_device)
        return self._loaders[(kind, index)].next_batches(restart=batch_idx == 0)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Non-final micro-batches of gradient accumulation: the windows add up in fp32."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch_idx = args[1]
        normalize = self.lightning_module.trainer.accumulate_grad_batches  # as Lightning's closure divides
        self._start_step()
        for rank, other in enumerate(self._others("train", 0, batch_idx), start=1):
            with self._as_rank(rank):
                output = super().training_step(other, batch_idx, *args[2:], **kwargs)
                loss = output["loss"] if isinstance(output, dict) else output
                (loss / normalize).backward()
            self.engine.receive_grads(rank, self._accumulating)
        with self._as_rank(0):
            return super().training_step(*args, **kwargs)

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        self.engine.receive_grads(0, self._accumulating)

    def _after_closure(self, model: pl.LightningModule, optimizer: Any) -> None:
        trainer = model.trainer
        self.engine.finish_grad_sync()
        self.precision_plugin._clip_gradients(
            model, optimizer, trainer.gradient_clip_val, gradient_clip_algorithm=trainer.gradient_clip_algorithm
        )
        self.engine.prepare_step()

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)  # rank 0's optimizer
        self.engine.step_other_ranks()
        self.comm_stats = self.engine.start_weight_sync()
        return output

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        batch_idx = args[1]
        index = args[2] if len(args) > 2 else kwargs.get("dataloader_idx", 0)
        for other in self._others("val", index, batch_idx):
            super().validation_step(other, *args[1:], **kwargs)
        return super().validation_step(*args, **kwargs)

    # ----------------------------------------------------------------------------------------
    # One process: collectives are the identity

    def barrier(self, name: str | None = None) -> None:
        """Nothing to wait for."""

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return tensor

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return tensor.unsqueeze(0)


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
