"""What the Trainer strategy and the Fabric strategy share: one copy, both adapters call it.

`SDP4BitStrategy` (lightning.pytorch) and `SDP4BitFabricStrategy` (lightning.fabric) are thin
adapters over the same `ShardedEngine`. Lightning's two strategy base classes have different
hook names, so each adapter keeps its own class, but everything they decide the same way lives
here: the precision and topology checks, process-group setup, the engine's construction, the
user-facing collectives, and the mapping of both checkpoint dicts onto
`lightning_sdp4bit.checkpoint`. Both drive the engine through its step protocol alone
(`lightning_sdp4bit.engine`).
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import nn

from lightning_sdp4bit import checkpoint as sharded_checkpoint
from lightning_sdp4bit import comm, ops
from lightning_sdp4bit.config import SDP4BitConfig
from lightning_sdp4bit.engine import ShardedEngine
from lightning_sdp4bit.stats import WireMeter
from lightning_sdp4bit.topology import Topology, create_process_groups

__all__ = [
    "DataParallelLayout",
    "SAVED_BY_FABRIC",
    "START_METHODS",
    "SUPPORTED_PRECISIONS",
    "barrier",
    "broadcast_object",
    "build_engine",
    "check_backend",
    "check_precision",
    "check_start_method",
    "check_sync_batchnorm_device",
    "check_timeout",
    "check_topology",
    "connect",
    "load_ordinary_state",
    "reduce",
    "refuse_finetuning_callbacks",
    "rewire_lightning_optimizers",
    "save_sharded",
    "callbacks_of",
    "clip_through",
    "set_rank_zero_only",
    "set_world_ranks",
    "timeouts_of",
]

SUPPORTED_PRECISIONS = ("bf16-true", "32-true", "bf16-mixed", "16-true")
START_METHODS = ("popen", "spawn", "fork", "forkserver")
# Key of Lightning's part of a sharded checkpoint that marks one written by Fabric; its value is
# {"module": state key, "optimizers": [state keys]} (the names the Fabric user saved them under).
SAVED_BY_FABRIC = "sdp4bit_saved_by_fabric"


class DataParallelLayout:
    """The properties both adapters answer alike: one process per device, on every node.

    Listed first among an adapter's bases, so that these satisfy both Lightning base classes'
    abstract properties. Expects `parallel_devices`, `local_rank`, `global_rank`, `_num_nodes`
    and `_process_group_backend` on the strategy."""

    if TYPE_CHECKING:  # what the strategy provides (Lightning's ParallelStrategy, after this mixin)
        parallel_devices: list[torch.device] | None
        local_rank: int
        global_rank: int
        _num_nodes: int
        _process_group_backend: str | None

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend


def check_precision(precision: str | None) -> None:
    """Refuse the precisions whose semantics break sharded optimizer state (None: not set yet)."""
    if precision is None or precision in SUPPORTED_PRECISIONS:
        return
    reason = (
        ": its GradScaler skips steps on each rank's own overflow check, so the ranks' sharded "
        "optimizer states would diverge"
        if precision == "16-mixed"
        else ""
    )
    raise ValueError(
        f"precision={precision!r} is not supported by the sdp4bit strategy{reason}. "
        f"Use one of {', '.join(map(repr, SUPPORTED_PRECISIONS))} ('bf16-true' is the paper's setting)."
    )


def check_start_method(start_method: str) -> None:
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {', '.join(map(repr, START_METHODS))}, got {start_method!r}")


def check_backend(backend: str | None, devices: list | None) -> None:
    """`process_group_backend=`: a backend this torch has (or "device:backend" pairs, as
    init_process_group takes), and NCCL only with CUDA devices. Refused while the Trainer or
    Fabric is built, not in every worker's process-group setup. None: Lightning's choice."""
    if backend is None:
        return
    names = [part.rpartition(":")[2].strip() for part in str(backend).split(",")]
    for name in names:
        if not name or not torch.distributed.is_backend_available(name):
            known = [b for b in torch.distributed.Backend.backend_list if b not in ("undefined", "fake")]
            available = [b for b in known if torch.distributed.is_backend_available(b)]
            raise ValueError(
                f"process_group_backend={backend!r}: {name!r} is not a backend this torch can use "
                f"(available here: {', '.join(available)})"
            )
    if "nccl" in names and devices and devices[0].type != "cuda" and ":" not in str(backend):
        raise ValueError(
            f"process_group_backend={backend!r} needs CUDA devices; these are {devices[0].type} (use 'gloo')"
        )


def check_timeout(timeout: Any) -> None:
    """`timeout=` bounds every collective the strategy waits on; torch.distributed takes a
    timedelta. Refused here, when the strategy is built, rather than in every worker's setup."""
    if timeout is not None and (not isinstance(timeout, timedelta) or timeout <= timedelta(0)):
        raise ValueError(
            f"timeout must be a datetime.timedelta above zero, or None for the backend's default, got {timeout!r}"
        )


def check_topology(config: SDP4BitConfig, num_nodes: int, num_processes: int, devices: list | None) -> None:
    """Topology and kernel-limit errors surface while the Trainer / Fabric is built, not in the workers."""
    config.resolve_ranks_per_node(num_nodes * num_processes, num_processes)
    if devices:
        ops.check_kernel_limits(config, devices[0].type)


def check_sync_batchnorm_device(module: nn.Module, device: torch.device) -> None:
    """torch's SyncBatchNorm trains on GPUs only: refuse it at setup, as DDP's constructor does,
    rather than at the first training step."""
    if device.type == "cpu" and any(isinstance(m, nn.SyncBatchNorm) for m in module.modules()):
        raise ValueError(
            "SyncBatchNorm layers (Trainer(sync_batchnorm=True) or nn.SyncBatchNorm.convert_sync_batchnorm) "
            "only work on GPU modules, under sdp4bit as under DDPStrategy; this module is on the CPU. Train on "
            "GPUs, or keep BatchNorm (every rank then takes rank 0's running statistics before a forward, as "
            "under DDP)."
        )


def refuse_finetuning_callbacks(trainer: Any) -> None:
    """BaseFinetuning maps the optimizer's tensors back to the module's parameters and adds
    parameter groups mid-fit; neither can hold when the optimizer steps sharded masters."""
    from lightning.pytorch.callbacks import BaseFinetuning

    for callback in callbacks_of(trainer):
        if isinstance(callback, BaseFinetuning):
            raise ValueError(
                f"{type(callback).__name__} (a BaseFinetuning callback) cannot run under sdp4bit: the set of "
                "trained parameters is fixed when fit starts, and the optimizer steps sharded fp32 masters, not "
                "the module's parameters. Freeze parameters before fit (requires_grad=False) and keep them frozen, "
                "or train them from the start in a parameter group whose learning rate you raise later."
            )


def clip_through(plugin: Any, engine: ShardedEngine) -> None:
    """Route a Trainer precision plugin's clipping to the engine: stock clip-by-norm would take
    each rank's local shard norm, not the global one, and both read gradients that must be
    reduced first (manual optimization clips before opt.step())."""

    def by_norm(optimizer: Any, clip_val: int | float) -> None:
        engine.clip_grad_norm(float(clip_val))

    def by_value(optimizer: Any, clip_val: int | float) -> None:
        engine.clip_grad_value(float(clip_val))

    plugin.clip_grad_by_norm, plugin.clip_grad_by_value = by_norm, by_value


def rewire_lightning_optimizers(wrappers: list[Any]) -> None:
    """The Trainer's LightningOptimizer wrappers copied their optimizers' class before it was
    sharded: give them the sharded optimizers' zero_grad (which ends the engine's gradient
    window) and add_param_group (which refuses)."""
    for wrapper in wrappers:
        wrapper.zero_grad = wrapper.optimizer.zero_grad
        wrapper.add_param_group = wrapper.optimizer.add_param_group


def set_world_ranks(strategy: Any) -> None:
    """Global rank = node_rank * processes per node + local rank, as DDP numbers them."""
    if strategy.cluster_environment is not None:
        strategy.cluster_environment.set_global_rank(strategy.node_rank * strategy.num_processes + strategy.local_rank)
        strategy.cluster_environment.set_world_size(strategy.num_nodes * strategy.num_processes)
    # Lightning's rank_zero_only (Trainer and Fabric) is lightning_utilities' one object.
    set_rank_zero_only(strategy.global_rank)


def set_rank_zero_only(rank: int) -> None:
    """The rank Lightning's `rank_zero_*` utilities see: lightning_utilities' `rank_zero_only`
    keeps it as an attribute of the function (which its type does not declare)."""
    utils_rank_zero_only.rank = rank  # type: ignore[attr-defined]


def callbacks_of(trainer: Any) -> list[Any]:
    """`trainer.callbacks`, which Lightning's callback connector sets at run time (undeclared)."""
    return trainer.callbacks


def connect(cluster_environment: Any, backend: str | None, timeout: timedelta | None, root_device: torch.device) -> str:
    """Join (or reuse) the default process group; returns the backend in use (gloo on CPU, NCCL on GPU)."""
    backend = backend or _get_default_process_group_backend_for_device(root_device)
    device_id = root_device if root_device.type != "cpu" else None
    already_initialized = _distributed_is_initialized()
    _init_dist_connection(cluster_environment, backend, timeout=timeout, device_id=device_id)
    if not already_initialized:
        # The group stays up after training (saving a checkpoint needs it), but left alive at
        # interpreter exit gloo's threads can abort the process ("terminate called without an
        # active exception") after a successful run: take it down first.
        atexit.register(_destroy_process_group)
    return backend


def _destroy_process_group() -> None:
    if _distributed_is_initialized():
        torch.distributed.destroy_process_group()


def build_engine(
    module: nn.Module,
    config: SDP4BitConfig,
    global_rank: int,
    world_size: int,
    num_processes: int,
    meter: WireMeter,
    timeout: timedelta | None,
    manual: bool = False,
    device: torch.device | None = None,
) -> ShardedEngine:
    """The engine over `module` (on its device, or on the meta device to be built on `device`,
    in its training dtype), its process groups bounded by the strategy's `timeout` (`manual`:
    see `ShardedEngine`). Collective."""
    ranks_per_node = config.resolve_ranks_per_node(world_size, num_processes)
    topology = Topology(global_rank, world_size, ranks_per_node)
    groups = create_process_groups(topology, timeout)
    return ShardedEngine(module, config, topology, groups, meter, manual=manual, device=device)


# The collectives the adapters run for Lightning and the user (sync_dist logging, barriers,
# broadcasts) wait on the default group, where a stalled rank is as likely to be noticed as in
# the engine's exchanges: a timeout there is named as the engine names its own (`comm.Timeouts`).


def timeouts_of(strategy: Any) -> comm.Timeouts:
    """The strategy's rank and `timeout=`, for the error of one of its collectives that times out."""
    return comm.Timeouts(strategy.global_rank, strategy._timeout)


def reduce(tensor: Any, group: Any, reduce_op: Any, timeouts: comm.Timeouts) -> Any:
    """A tensor reduced over the ranks (self.log(sync_dist=True), fabric.all_reduce); anything else as is."""
    if not isinstance(tensor, torch.Tensor):
        return tensor
    with timeouts.named("the strategy's all-reduce for sync_dist logging or all_reduce"):
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


def barrier(root_device: torch.device, timeouts: comm.Timeouts) -> None:
    if not _distributed_is_initialized():
        return
    with timeouts.named("the strategy's barrier"):
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[root_device.index])
        else:
            torch.distributed.barrier()


def broadcast_object(obj: Any, src: int, timeouts: comm.Timeouts) -> Any:
    if not _distributed_is_initialized():
        return obj
    holder = [obj]
    with timeouts.named("the strategy's broadcast"):
        torch.distributed.broadcast_object_list(holder, src, group=_group.WORLD)
    return holder[0]


def save_sharded(
    engine: ShardedEngine,
    optimizers: list[torch.optim.Optimizer],
    checkpoint: dict[str, Any],
    path: str | os.PathLike,
    barrier_fn: Callable[[], None],
) -> None:
    """Write the sharded directory; `checkpoint` holds everything but the weights and optimizer
    state (Lightning's dict, or a Fabric user's other entries). Collective."""
    # The weight shards written must be the replicas' current ones, in-place edits since the step
    # must be in the masters, and none of it may be non-finite (before_save raises on every rank).
    engine.before_save()
    sharded_checkpoint.save_sharded(engine, optimizers, checkpoint, path, barrier_fn)


def load_ordinary_state(
    engine: ShardedEngine,
    optimizers: list[torch.optim.Optimizer] | None,
    state_dict: dict[str, Any],
    optimizer_states: list[dict[str, Any]],
) -> None:
    """Restore from an ordinary (single-file) checkpoint: a consolidated one, or DDP's. Without
    optimizer states only the weights and masters are restored. The trained parameters' values
    go straight into the buckets; only the rest (buffers, frozen parameters) through the module:
    written through it, a trained one would gather its bucket under weight_sharding="node", and
    all of them the whole model. `check_state_dict` comes first."""
    engine.wait_weights()
    full = sharded_checkpoint.full_state_from_lightning(
        {"state_dict": state_dict, "optimizer_states": optimizer_states}, engine.optimizer_param_names
    )
    sharded_checkpoint.load_full_state(engine, optimizers if full["optimizers"] else None, full)
    module = engine.module
    trained = {name for name, param in module.named_parameters(remove_duplicate=False) if param.requires_grad}
    module.load_state_dict({k: v for k, v in state_dict.items() if k not in trained}, strict=False)
