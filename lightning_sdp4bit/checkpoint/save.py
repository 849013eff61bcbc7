"""Writing a sharded checkpoint so that a crash at any instant leaves a complete one at the path.

The save runs in three phases, each ended by one `agree` (so a failure on any rank raises the
same CheckpointError on every rank, and nothing hangs):

1. rank 0 picks the folder for the new generation and makes it:
   - the path already holds a complete checkpoint: `x.ckpt/gen_<n+1>/`, beside the committed
     generation n, which stays valid until the commit;
   - otherwise (a fresh name, or an ordinary file or foreign folder to replace): a staging
     directory `x.ckpt.partial/gen_000000/`;
2. every rank writes its shard into that folder, and hashes it (XXH3-64) as it writes;
3. rank 0 writes meta.pt, then the manifest (temporary name, fsync, rename: the commit). A staging
   directory is then renamed to the path (what stood there moves to `x.ckpt.old` first).

Until the commit the previous checkpoint is the one found; after it, the new one. The rename of
a staging directory is itself atomic, except when an ordinary file or a foreign folder stood at
the path: between moving it aside and renaming the staging directory, the complete new
checkpoint is at `x.ckpt.partial`, which `find_checkpoint` loads (and the next save moves into
place). Leftovers (other generations, `.partial`, `.old`, `.tmp`) are removed after the commit
and by `remove_checkpoint`.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_sdp4bit.checkpoint import lock
from lightning_sdp4bit.checkpoint.changes import class_name
from lightning_sdp4bit.checkpoint.files import (
    FORMAT,
    MANIFEST,
    META,
    FileRecord,
    Manifest,
    agree,
    checksummed_save,
    describe,
    is_sharded_checkpoint,
    read_manifest,
    shard_file,
    sibling,
    sync_directory,
    tensor_records,
    write_manifest,
)
from lightning_sdp4bit.checkpoint.recovery import finish_interrupted_save
from lightning_sdp4bit.engine import ShardedEngine

__all__ = ["fragment_map", "layout_record", "remove_checkpoint", "save_sharded"]

_LIGHTNING_HEAVY_KEYS = ("state_dict", "optimizer_states")
_FIRST_GENERATION = "gen_000000"


def layout_record(engine: ShardedEngine) -> list[dict[str, Any]]:
    """Per bucket: dtype, shard elements and (name, shape, first element) of each parameter."""
    return [
        {
            "dtype": b.layout.dtype,
            "shard_numel": b.layout.shard_numel,
            "slots": [(s.name, s.shape, s.start) for s in b.layout.slots],
        }
        for b in engine.buckets
    ]


def parameter_aliases(module: torch.nn.Module, trained: set[str]) -> dict[str, str]:
    """Second names of trained parameters (a head tied to the embedding: "head.weight" ->
    "embed.weight"), so that a consolidated state_dict gives both names the same values."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) not in first:
            first[id(param)] = name
        elif first[id(param)] in trained:
            aliases[name] = first[id(param)]
    return aliases


def untrained_state(module: torch.nn.Module, trained: set[str], aliases: dict[str, str]) -> dict[str, Tensor]:
    """The module's state outside the buckets (buffers, frozen parameters), on the CPU. The
    trained parameters and their second names are left out before any value is read: the shards
    hold them, and under weight_sharding="node" a read of a released one gathers its bucket, a
    collective that rank 0, writing meta.pt alone, would wait in for peers that never join.
    (Checkpoints before 2026-12-04 also hold the second names' values; loads take both.)"""
    skip = trained | aliases.keys()
    state = module.state_dict(keep_vars=True)  # no detach(): that would read every parameter
    return {k: v.detach().cpu() for k, v in state.items() if k not in skip and isinstance(v, Tensor)}


def fragment_map(engine: ShardedEngine, optimizer_index: int) -> list[tuple[str, int, int]]:
    """(name, first element, count) of each parameter index of one re-pointed optimizer."""
    out = []
    for names in engine.optimizer_param_names[optimizer_index]:
        for name in names:
            for record in engine.fragments_by_name.get(name, []):
                out.append((name, record.fragment.param_start, record.fragment.numel))
    return out


def save_sharded(
    engine: ShardedEngine,
    optimizers: list[torch.optim.Optimizer],
    checkpoint: dict[str, Any],
    path: str | os.PathLike,
    barrier: Callable[[], None],
) -> None:
    """Write `path` as a sharded checkpoint directory. Collective: every rank calls it.

    `checkpoint` is Lightning's checkpoint dict (or any dict of small picklable state); its
    "state_dict" and "optimizer_states" are not stored, the shards hold them. `barrier` holds
    every rank until rank 0 has removed the leftovers, so that none returns early. Rank 0 holds
    `path`'s writer lock (`lock`) from the first phase to the end: another job saving to the same
    path is refused on every rank with a CheckpointError that names it.
    """
    try:
        _save_locked(engine, optimizers, checkpoint, Path(path), barrier)
    finally:
        if engine.topology.rank == 0:
            lock.release(Path(path))


def _save_locked(
    engine: ShardedEngine,
    optimizers: list[torch.optim.Optimizer],
    checkpoint: dict[str, Any],
    path: Path,
    barrier: Callable[[], None],
) -> None:
    rank, group = engine.topology.rank, engine.groups.world
    plan, error = None, None
    if rank == 0:
        try:
            plan = _prepare(path)
        except Exception as caught:
            error = f"saving {path}: {describe(caught)}"
    directory, generation = agree(error, plan, group, engine.timeouts)[0]
    folder = Path(directory) / generation

    record, error = None, None
    try:
        shard = {
            "rank": rank,
            "step": engine.step,  # meta.pt's engine_step: a shard of another save differs (`changes`)
            "buckets": [{"master": b.master.cpu(), "weights": b.weight_shard.cpu()} for b in engine.buckets],
            "optimizers": [_to_cpu(opt.state_dict()) for opt in optimizers],
            "fragments": [fragment_map(engine, index) for index in range(len(optimizers))],
        }
        record = FileRecord(*checksummed_save(shard, folder / shard_file(rank)), rank, tensor_records(shard))
    except Exception as caught:
        error = f"saving {folder / shard_file(rank)}: {describe(caught)}"
    records = agree(error, record, group, engine.timeouts)

    error = None
    if rank == 0:
        try:
            _commit(engine, optimizers, checkpoint, path, Path(directory), generation, records)
        except Exception as caught:
            error = f"saving {path}: {describe(caught)}"
    agree(error, None, group, engine.timeouts)
    if rank == 0:
        _remove_leftovers(path, generation)
    barrier()


def _prepare(path: Path) -> tuple[str, str]:
    """Rank 0, phase 1: (directory that gets the manifest, generation folder inside it)."""
    # The checkpoint's folder may not exist yet (ModelCheckpoint's first save): its lock lives there.
    if not path.parent.is_dir():
        path.parent.mkdir(parents=True)
    lock.acquire(path)  # released by save_sharded, whatever happens
    partial = sibling(path, ".partial")
    # A previous first save interrupted just before its last rename: finish it, so that its
    # (complete) checkpoint is not lost to this save's staging directory.
    finish_interrupted_save(path)
    if is_sharded_checkpoint(path):
        generation = _next_generation(read_manifest(path).generation)
        _remove(path / generation)  # from an earlier attempt that crashed before its commit
        (path / generation).mkdir()
        return str(path), generation
    _remove(partial)
    partial.mkdir(parents=True)
    (partial / _FIRST_GENERATION).mkdir()
    return str(partial), _FIRST_GENERATION


def _next_generation(generation: str) -> str:
    return f"gen_{int(generation.rsplit('_', 1)[1]) + 1:06d}"


def _commit(
    engine: ShardedEngine,
    optimizers: list[torch.optim.Optimizer],
    checkpoint: dict[str, Any],
    path: Path,
    directory: Path,
    generation: str,
    records: list[FileRecord],
) -> None:
    """Rank 0, phase 3: meta.pt, then the manifest (the commit), then the staging rename."""
    trained = {slot.name for b in engine.buckets for slot in b.layout.slots}
    aliases = parameter_aliases(engine.module, trained)
    meta = {
        "format": FORMAT,
        "world_size": engine.topology.world_size,
        "layout": layout_record(engine),
        "config": engine.config.to_dict(),
        "engine_step": engine.step,
        "meter": engine.meter.state_dict(),
        "skipped_steps": engine.skipped.exact(),
        "untrained_state": untrained_state(engine.module, trained, aliases),
        "optimizer_param_names": engine.optimizer_param_names,
        "optimizer_classes": [class_name(optimizer) for optimizer in optimizers],
        "aliases": aliases,
        "lightning": {k: v for k, v in checkpoint.items() if k not in _LIGHTNING_HEAVY_KEYS},
    }
    size, checksum = checksummed_save(meta, directory / generation / META)
    files = {META: FileRecord(size, checksum), **{shard_file(r): record for r, record in enumerate(records)}}
    parameters = {
        slot.name: (tuple(slot.shape), str(b.layout.dtype)) for b in engine.buckets for slot in b.layout.slots
    }
    sync_directory(directory / generation)
    write_manifest(directory, Manifest(generation, engine.topology.world_size, files, parameters))
    if directory != path:
        if path.exists() or path.is_symlink():
            old = sibling(path, ".old")
            _remove(old)
            os.replace(path, old)
        os.replace(directory, path)
        sync_directory(path.parent)


def _remove_leftovers(path: Path, generation: str) -> None:
    """Rank 0, after the commit: everything but the manifest and the committed generation."""
    leftovers = [p for p in path.iterdir() if p.name not in (MANIFEST, generation)]
    leftovers += [p for p in (sibling(path, ".partial"), sibling(path, ".old")) if p.exists() or p.is_symlink()]
    for leftover in leftovers:
        try:
            _remove(leftover)
        except OSError as error:
            # The checkpoint is committed and complete; the next save tries again.
            warnings.warn(f"sdp4bit: could not remove {leftover}, left by an earlier save: {error}", stacklevel=3)


def remove_checkpoint(path: str | os.PathLike) -> None:
    """Delete a checkpoint (a sharded directory or an ordinary file) and the `.partial` and
    `.old` leftovers of interrupted saves beside it. Not collective: call it on one rank."""
    path = Path(path)
    for target in (path, sibling(path, ".partial"), sibling(path, ".old")):
        _remove(target)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value
