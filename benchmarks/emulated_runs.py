"""One run of the emulated-network benchmark: a model, a row (plain, the engine with a preset, or
Lightning's Trainer with SDP4BitStrategy) and its phases, timed by phase_timer.PhaseTimer.

Every run builds its model, optimizer and engine, and leaves nothing behind it: the caller runs it
inside `fresh_state()`, which checks that, and empties the allocator, so a row measured after
another starts from the same state as the first.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import weakref
from collections.abc import Callable, Iterator

import lightning as L
import torch
from emulation import Network
from gpt_step import VOCAB, build_gpt, engine_step, lm_loss, make_optimizer, plain_step, random_tokens
from phase_timer import Phase, PhaseTimer
from torch.utils.data import DataLoader, Dataset

from lightning_sdp4bit import SDP4BitConfig, SDP4BitStrategy, ops
from lightning_sdp4bit.engine import ShardedEngine
from lightning_sdp4bit.topology import Topology


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    n_layer: int
    n_embd: int
    batch: int
    seq: int
    n_head: int = 16
    vocab: int = VOCAB
    checkpoint: bool = False  # recompute each block's activations in the backward (gpt_step.build_gpt)

    def build(self, device: torch.device):
        return build_gpt(self.n_layer, self.n_head, self.n_embd, self.seq, device, self.vocab, self.checkpoint)

    def tokens(self, device: torch.device) -> torch.Tensor:
        return random_tokens(self.batch, self.seq, device, self.vocab)


MODELS = {
    "356m": ModelSpec(24, 1024, batch=8, seq=2048),
    "1.3b": ModelSpec(24, 2048, batch=4, seq=2048),
    # 6.7B: bf16 weights and gradients take 27 GB, the plain step's bf16 AdamW state 27 GB more, the
    # activations of 2 x 2048 tokens about 17 GB (~32 bytes x width per token and layer): it fits
    # in an H200 without activation checkpointing, which would add a third more compute for the
    # communication to hide behind. `6.7b-ckpt` is the same model checkpointed, as large jobs run.
    "6.7b": ModelSpec(32, 4096, batch=2, seq=2048, n_head=32),
    "6.7b-ckpt": ModelSpec(32, 4096, batch=2, seq=2048, n_head=32, checkpoint=True),
    "tiny": ModelSpec(2, 64, batch=2, seq=32, n_head=4, vocab=512),  # the dry run's: ~0.1M parameters
    "tiny-ckpt": ModelSpec(2, 64, batch=2, seq=32, n_head=4, vocab=512, checkpoint=True),
}
DRY_RUN_MODELS = ("tiny", "tiny-ckpt")
ENGINE_ROWS = ("baseline", "qwd", "tlq_hs", "sdp4bit", "qw+ulq")
SCENARIOS = ("nvlink", "ib400", "eth100", "custom")
SETTLE = 1  # untimed steps after a rate change: they carry the previous phase's in-flight all-gathers


# Latency of one message step, microseconds (NVLink, NIC), by scenario. NCCL's own cost model
# (src/graph/tuning.cc) charges a ring step 0.47 / 1.9 / 3.4 us over NVLink and 2.7 / 4.0 / 9.6 us
# over the network for its LL / LL128 / Simple protocols: 2 us over NVLink; 5 us per message over
# InfiniBand (RDMA); 10 us over 100 Gb/s Ethernet, whose RoCE or TCP messages cost more.
SCENARIO_LATENCY_US = {"nvlink": (2.0, 0.0), "ib400": (2.0, 5.0), "eth100": (2.0, 10.0), "custom": (2.0, 8.0)}


def scenario_phase(name: str, args: argparse.Namespace) -> Phase:
    """GB/s per GPU: Gb/s / 8. One node has no NIC; eth100's 100 Gb/s is the node's, shared.
    Latency: SCENARIO_LATENCY_US, or --latency-us for every scenario."""
    gbps = {"nvlink": math.inf, "ib400": 400, "eth100": 100 / args.ranks_per_node, "custom": args.link_gbps}[name]
    latency = getattr(args, "latency_us", None)  # absent from --json files written before it
    nvlink_us, nic_us = SCENARIO_LATENCY_US[name] if latency is None else latency
    return Phase(name, args.nvlink_gbs, gbps / 8, nvlink_us, nic_us)


def row_config(row: str, ranks_per_node: int, bucket_numel: int | None) -> SDP4BitConfig:
    extra = {"bucket_numel": bucket_numel} if bucket_numel else {}
    if row == "qw+ulq":
        return SDP4BitConfig.preset("ulq", weight_quant="direct", ranks_per_node=ranks_per_node, **extra)
    return SDP4BitConfig.preset(row, ranks_per_node=ranks_per_node, **extra)


@contextlib.contextmanager
def fresh_state(row: str, device: torch.device) -> Iterator[list[weakref.ref]]:
    """Run one job inside: `with fresh_state(row, device) as watched: run(..., watched)`.

    The run appends weak references to what must die with it (model, engine, strategy). After
    the run, with its frame gone: RuntimeError naming `row` if any of them is still alive, or if
    the GPU holds more allocated memory than before the run (beyond LAZY_STATE_BYTES); then the
    allocator is emptied and its peak reset, so that the next run starts as the first did. An
    exception inside skips the check.
    """
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        _clear_cublas_workspaces()
    before = torch.cuda.memory_allocated() if cuda else 0
    watched: list[weakref.ref] = []
    yield watched
    gc.collect()
    alive = sorted({type(obj).__name__ for obj in (ref() for ref in watched) if obj is not None})
    if alive:
        raise RuntimeError(f"{row}: its {', '.join(alive)} outlived the run (something still refers to it)")
    if cuda:
        torch.cuda.synchronize()
        _clear_cublas_workspaces()
        after = torch.cuda.memory_allocated()
        if after - before > LAZY_STATE_BYTES:
            raise RuntimeError(f"{row}: {after - before} bytes still allocated after the run ({before} before it)")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# What a run may leave allocated: process-wide state that torch or Triton set up lazily on first use
# (none is known; a model's weights are hundreds of MiB, so a leaked run cannot hide under this).
LAZY_STATE_BYTES = 16 * 2**20


def _clear_cublas_workspaces() -> None:
    # cuBLAS keeps a workspace per (handle, stream) in the caching allocator for the process's
    # life: not the run's memory, but memory_allocated() counts it.
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def run_plain(spec: ModelSpec, args, device, profile: str | None, watched: list) -> dict:
    model = spec.build(device)
    watched.append(weakref.ref(model))
    optimizer, tokens = make_optimizer(model.parameters(), device), spec.tokens(device)
    timer = PhaseTimer(None, [Phase("compute")], args, profile)
    for _ in range(timer.total_steps):
        plain_step(model, optimizer, tokens, timer.mark)
        timer.after_step()
    result = timer.results()["compute"]
    result["params"] = sum(p.numel() for p in model.parameters())
    return result


def run_engine(
    spec: ModelSpec, row: str, bucket_numel: int | None, topology: Topology, phases, args, device, profile, watched
) -> dict:
    network = Network(device, topology, args.lightning_lane)
    with network.install():
        model = spec.build(device)
        config = row_config(row, topology.ranks_per_node, bucket_numel)
        engine = ShardedEngine(model, config, topology, network.groups())
        watched += [weakref.ref(model), weakref.ref(engine)]
        optimizer = make_optimizer(model.parameters(), device)
        engine.shard_optimizer(optimizer)
        tokens = spec.tokens(device)
        timer = PhaseTimer(network, phases, args, profile)
        with marking_the_turn(model, engine, timer) as new_step:
            for _ in range(timer.total_steps):
                new_step()
                engine_step(model, engine, optimizer, tokens, timer.mark)
                timer.after_step()
        results = timer.results()
        for result in results.values():
            result["end_bucket_share"] = end_bucket_share(engine)
        engine.close()
    return results


def end_bucket_share(engine: ShardedEngine) -> float:
    """The share of the elements in the bucket at both ends of the step (emulated_tables.step_bound):
    the last, whose weights go out first and whose gradients are final last."""
    return engine.buckets[-1].layout.numel / sum(bucket.layout.numel for bucket in engine.buckets)


@contextlib.contextmanager
def marking_the_turn(model: torch.nn.Module, engine: ShardedEngine, timer: PhaseTimer) -> Iterator[Callable[[], None]]:
    """Mark the turn from forward to backward in each step, where the network link has nothing to
    send, with hooks of the benchmark's own (the engine's are left as they are):
    `timer.point("last_weights")` when the forward first reaches a module that owns a parameter of
    bucket 0 (the last layers': the last bucket it needs; its pre-hook runs after the engine's,
    which waits for that bucket), `timer.point("first_gradients")` once the backward has finished
    every gradient of bucket 0 (the first it completes; these hooks run after the engine's). Yields
    what to call before each step; on leaving, the hooks are removed."""
    params = engine.buckets[0].params
    owned = {id(param) for param in params}
    state = {"waited": False, "arrived": 0}

    def reached(module: torch.nn.Module, args: tuple) -> None:
        if not state["waited"]:
            state["waited"] = True
            timer.point("last_weights")

    def finished(param: torch.Tensor) -> None:
        state["arrived"] += 1
        if state["arrived"] == len(params):
            timer.point("first_gradients")

    owners = [m for m in model.modules() if any(id(p) in owned for p in m.parameters(recurse=False))]
    handles = [module.register_forward_pre_hook(reached) for module in owners]
    handles += [param.register_post_accumulate_grad_hook(finished) for param in params]
    try:
        yield lambda: state.update(waited=False, arrived=0)
    finally:
        for handle in handles:
            handle.remove()


class EmulatedStrategy(SDP4BitStrategy):
    """SDP4BitStrategy as rank 0 of `world` ranks, in this one process.

    Lightning sees `world` ranks (so it injects a DistributedSampler of `world` replicas and runs
    its per-batch SIGTERM broadcast); the launcher starts nothing; setup_environment still
    initialises a real one-rank process group, which torch.distributed.is_initialized() needs.
    The engine's groups come from Network.groups (Network.install patches create_process_groups).
    Everything else is the real adapter.
    """

    def __init__(self, config: SDP4BitConfig, world: int, mark: Callable[[str], None] = lambda segment: None):
        super().__init__(config)
        self._emulated_world = world
        self._mark = mark  # PhaseTimer.mark: the step's segments end where engine_step marks them

    @property
    def world_size(self) -> int:
        return self._emulated_world

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": self._emulated_world, "rank": 0}

    def _configure_launcher(self) -> None:
        self.config.resolve_ranks_per_node(self._emulated_world)  # fail now, as the real one does
        if self.parallel_devices:
            ops.check_kernel_limits(self.config, self.parallel_devices[0].type)
        self._launcher = None

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        self._mark("forward")  # the loss is queued: where engine_step marks the forward's end
        super().pre_backward(closure_loss)

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)  # the gradient exchanges completed: the backward's end
        self._mark("backward")


class _Tokens(Dataset):
    """`length` samples of seq + 1 tokens, cycling through one batch's worth."""

    def __init__(self, spec: ModelSpec, length: int):
        self.tokens, self.length = spec.tokens(torch.device("cpu")), length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.tokens[index % len(self.tokens)]


class GPTModule(L.LightningModule):
    def __init__(self, spec: ModelSpec, device: torch.device):
        super().__init__()
        self.gpt = spec.build(device)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return lm_loss(self.gpt, batch)

    def configure_optimizers(self):
        return make_optimizer(self.parameters(), self.device)


class _StepMarks(L.Callback):
    """The timer's step boundaries and the turn's points (`marking_the_turn`), as run_engine has
    them; EmulatedStrategy marks the forward's and the backward's ends."""

    reads_weights = False  # sdp4bit: these hooks need no complete weights, so they cost no overlap

    def __init__(self, timer: PhaseTimer):
        self.timer, self._new_step = timer, lambda: None
        self._watch = contextlib.ExitStack()

    def on_train_start(self, trainer, pl_module) -> None:
        # The engine exists from setup; teardown, which runs whatever happened, stops the watch.
        self._new_step = self._watch.enter_context(marking_the_turn(pl_module, trainer.strategy.engine, self.timer))

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._watch.close()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._new_step()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.timer.after_step()


def trainer_and_data(spec: ModelSpec, strategy: EmulatedStrategy, device: torch.device, steps: int, callback):
    """The Trainer of a Trainer row (bf16, clipping at 1.0, nothing logged or saved) for `steps`
    steps with `callback`, and the loader of rank 0's batches for them."""
    trainer = L.Trainer(
        accelerator=device.type if device.type == "cpu" else "gpu",
        devices=1,
        strategy=strategy,
        precision="bf16-true",
        max_steps=steps,
        gradient_clip_val=1.0,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    # Pinned, as a GPU user's loader is: from pageable memory Lightning's copy of each batch to the
    # GPU synchronises the stream (16.7 ms of host waits in 3 steps of the 1.3B trace).
    data = DataLoader(
        _Tokens(spec, strategy.world_size * spec.batch * steps), spec.batch, pin_memory=device.type == "cuda"
    )
    return trainer, data


def run_trainer(
    spec: ModelSpec, preset: str, bucket_numel: int | None, topology: Topology, phases, args, device, profile, watched
) -> dict:
    network = Network(device, topology, args.lightning_lane)
    timer = PhaseTimer(network, phases, args, profile)
    config = row_config(preset, topology.ranks_per_node, bucket_numel)
    strategy = EmulatedStrategy(config, topology.world_size, timer.mark)
    trainer, data = trainer_and_data(spec, strategy, device, timer.total_steps, _StepMarks(timer))
    module = GPTModule(spec, device)
    with network.install():
        trainer.fit(module, data)
    watched += [weakref.ref(module), weakref.ref(strategy), weakref.ref(strategy.engine)]
    results = timer.results()
    for result in results.values():
        result["end_bucket_share"] = end_bucket_share(strategy.engine)
    return results
