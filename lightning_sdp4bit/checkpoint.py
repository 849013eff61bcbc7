"""Sharded checkpoints: save, load (on any world size), and consolidate into one ordinary file.

A checkpoint is a directory:
- `meta.pt`, written by rank 0: the format tag, the world size, the bucket layout, the config,
  the engine's step, the module's untrained entries (buffers, frozen parameters), the
  optimizers' parameter names per group, and the rest of Lightning's checkpoint dict (loops,
  schedulers, callbacks, ...);
- `shard_00000.pt`, one per rank: per bucket the fp32 master shard [S] and the model weights'
  slice [S] (the replicas every rank holds, which with qWD differ from rounded masters), the
  rank's optimizer state dicts, and the layout map: for each optimizer parameter index, the
  (parameter name, first element, element count) of the fragment it steps.

Writes are atomic: the directory is written under `<path>.partial` (each file itself written
under a temporary name and renamed) and renamed into place once complete.

Loading with the layout it was saved with reads one shard per rank. Otherwise (another world
size, bucket size or alignment) every rank reads all shards, rebuilds each parameter's full
master weights, weights and elementwise optimizer state by name (the **full state**), and cuts
its own fragments out of it. An ordinary single-file checkpoint (consolidated, or DDP's) loads
through the same full state, so a run can move between strategies.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_sdp4bit.engine import ShardedEngine

__all__ = [
    "FORMAT",
    "consolidate_checkpoint",
    "is_sharded_checkpoint",
    "load_full_state",
    "load_sharded",
    "read_meta",
    "read_full_state",
    "save_sharded",
]

FORMAT = "lightning-sdp4bit/sharded-v1"
META = "meta.pt"
_LIGHTNING_HEAVY_KEYS = ("state_dict", "optimizer_states")


def _shard_file(rank: int) -> str:
    return f"shard_{rank:05d}.pt"


def _atomic_save(obj: Any, path: Path) -> None:
    temporary = path.with_name(path.name + ".tmp")
    torch.save(obj, temporary)
    os.replace(temporary, path)


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / META).is_file()


def _layout_record(engine: ShardedEngine) -> list[dict[str, Any]]:
    return [
        {
            "dtype": b.layout.dtype,
            "shard_numel": b.layout.shard_numel,
            "slots": [(s.name, s.shape, s.start) for s in b.layout.slots],
        }
        for b in engine.buckets
    ]


def _fragment_map(engine: ShardedEngine, optimizer_index: int) -> list[tuple[str, int, int]]:
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
    """Write `path` as a sharded checkpoint directory. Collective: every rank calls it."""
    path, rank = Path(path), engine.topology.rank
    partial = path.with_name(path.name + ".partial")
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    barrier()
    shard = {
        "rank": rank,
        "buckets": [{"master": b.master.cpu(), "weights": b.weight_shard.cpu()} for b in engine.buckets],
        "optimizers": [_to_cpu(opt.state_dict()) for opt in optimizers],
        "fragments": [_fragment_map(engine, index) for index in range(len(optimizers))],
    }
    _atomic_save(shard, partial / _shard_file(rank))
    barrier()
    if rank == 0:
        trained = {slot.name for b in engine.buckets for slot in b.layout.slots}
        meta = {
            "format": FORMAT,
            "world_size": engine.topology.world_size,
            "layout": _layout_record(engine),
            "config": engine.config.to_dict(),
            "engine_step": engine.step,
            "meter": engine.meter.state_dict(),
            "untrained_state": {
                k: v.cpu() for k, v in engine.module.state_dict().items() if k not in trained and isinstance(v, Tensor)
            },
            "optimizer_param_names": engine.optimizer_param_names,
            "lightning": {k: v for k, v in checkpoint.items() if k not in _LIGHTNING_HEAVY_KEYS},
        }
        _atomic_save(meta, partial / META)
        previous = path.with_name(path.name + ".old")
        if path.exists():
            shutil.rmtree(previous, ignore_errors=True)
            os.replace(path, previous)
        os.replace(partial, path)
        shutil.rmtree(previous, ignore_errors=True)
    barrier()


def _to_cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The small meta.pt of a sharded checkpoint (no tensors of the model's size)."""
    path = Path(path)
    meta = torch.load(path / META, map_location="cpu", weights_only=False)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a lightning-sdp4bit sharded checkpoint (format {meta.get('format')!r})")
    return meta


def load_sharded(
    engine: ShardedEngine, optimizers: list[torch.optim.Optimizer] | None, path: str | os.PathLike
) -> dict[str, Any]:
    """Restore masters, weights, the engine's step and (if `optimizers` is given) optimizer
    state from a sharded checkpoint into a running engine. Returns the meta dict (Lightning's
    part under "lightning"). Collective: every rank calls it."""
    path = Path(path)
    meta = read_meta(path)
    _check_parameters(engine, {name for bucket in meta["layout"] for name, *_ in bucket["slots"]}, exact=True)
    same_layout = meta["world_size"] == engine.topology.world_size and meta["layout"] == _layout_record(engine)
    if same_layout:
        shard = torch.load(path / _shard_file(engine.topology.rank), map_location="cpu", weights_only=False)
        with torch.no_grad():
            for bucket, saved in zip(engine.buckets, shard["buckets"], strict=True):
                bucket.master.copy_(saved["master"])
                bucket.weight_shard.copy_(saved["weights"])
        engine.gather_weight_shards()
        if optimizers is not None:
            if shard["fragments"] != [_fragment_map(engine, i) for i in range(len(optimizers))]:
                raise ValueError(
                    f"{path}: the optimizers' parameter groups differ from those the checkpoint was saved with"
                )
            for optimizer, state in zip(optimizers, shard["optimizers"], strict=True):
                optimizer.load_state_dict(state)
    else:
        load_full_state(engine, optimizers, read_full_state(path))
    engine.step = int(meta["engine_step"])
    engine.meter.load_state_dict(meta["meter"])
    return meta


def read_full_state(path: str | os.PathLike) -> dict[str, Any]:
    """Every parameter's full master weights, model weights and optimizer state, by name, from
    all shards of a sharded checkpoint (the memory of the whole model's training state)."""
    path = Path(path)
    meta = read_meta(path)
    shapes = {name: shape for bucket in meta["layout"] for name, shape, _ in bucket["slots"]}
    masters = {name: torch.empty(shape, dtype=torch.float32).view(-1) for name, shape in shapes.items()}
    weights: dict[str, Tensor] = {}
    optimizers: list[dict[str, Any]] = []
    for rank in range(meta["world_size"]):
        shard = torch.load(path / _shard_file(rank), map_location="cpu", weights_only=False)
        for bucket_meta, saved in zip(meta["layout"], shard["buckets"], strict=True):
            lo = rank * bucket_meta["shard_numel"]
            for name, shape, start in bucket_meta["slots"]:
                numel = int(torch.Size(shape).numel())
                a, b = max(lo, start), min(lo + bucket_meta["shard_numel"], start + numel)
                if a < b:
                    masters[name][a - start : b - start] = saved["master"][a - lo : b - lo]
                    target = weights.setdefault(name, torch.empty(numel, dtype=bucket_meta["dtype"]))
                    target[a - start : b - start] = saved["weights"][a - lo : b - lo]
        for index, (state_dict, fragments) in enumerate(zip(shard["optimizers"], shard["fragments"], strict=True)):
            if len(optimizers) <= index:
                optimizers.append({"param_groups": state_dict["param_groups"], "state": {}})
            _merge_fragment_states(optimizers[index]["state"], state_dict["state"], fragments, shapes)
    return {
        "masters": {name: t.view(shapes[name]) for name, t in masters.items()},
        "weights": {name: t.view(shapes[name]) for name, t in weights.items()},
        "optimizers": optimizers,
        "optimizer_param_names": meta["optimizer_param_names"],
    }


def _merge_fragment_states(full: dict, states: dict, fragments: list, shapes: dict) -> None:
    for index, (name, start, numel) in enumerate(fragments):
        for key, value in states.get(index, {}).items():
            slot = full.setdefault(name, {})
            if isinstance(value, Tensor) and value.dim() > 0:
                if value.numel() != numel:
                    raise ValueError(
                        f"optimizer state {key!r} of {name!r} has {value.numel()} elements for a fragment of "
                        f"{numel}: it is not elementwise, so it cannot be resharded; resume on the world size "
                        "and bucket_numel it was saved with"
                    )
                tensor = slot.setdefault(key, torch.zeros(torch.Size(shapes[name]).numel(), dtype=value.dtype))
                tensor[start : start + numel] = value.reshape(-1)
            else:
                slot[key] = value


def load_full_state(
    engine: ShardedEngine, optimizers: list[torch.optim.Optimizer] | None, full: dict[str, Any]
) -> None:
    """Cut this rank's masters, weights and optimizer fragments out of a full state."""
    _check_parameters(engine, set(full["masters"]), exact=False)
    with torch.no_grad():
        for bucket in engine.buckets:
            for slot, param in zip(bucket.layout.slots, bucket.params, strict=True):
                param.copy_(full["weights"].get(slot.name, full["masters"][slot.name]).view(slot.shape))
            for frag in bucket.layout.fragments(engine.topology.rank):
                source = full["masters"][frag.name].reshape(-1)[frag.param_start : frag.param_start + frag.numel]
                bucket.master[frag.shard_start : frag.shard_start + frag.numel].copy_(source)
    if optimizers is None:
        return
    if len(full["optimizers"]) != len(optimizers):
        raise ValueError(
            f"the checkpoint holds {len(full['optimizers'])} optimizer states, the module has {len(optimizers)}"
        )
    for index, (optimizer, saved) in enumerate(zip(optimizers, full["optimizers"], strict=True)):
        if [len(g) for g in full["optimizer_param_names"][index]] != [
            len(g) for g in engine.optimizer_param_names[index]
        ]:
            raise ValueError(f"optimizer {index}'s parameter groups differ from those in the checkpoint")
        state, groups, position = {}, [], 0
        for saved_group, names in zip(saved["param_groups"], engine.optimizer_param_names[index], strict=True):
            params = []
            for name in names:
                for record in engine.fragments_by_name.get(name, []):
                    frag = record.fragment
                    entry = {}
                    for key, value in saved["state"].get(name, {}).items():
                        if isinstance(value, Tensor) and value.dim() > 0:
                            value = value.reshape(-1)[frag.param_start : frag.param_start + frag.numel].clone()
                        entry[key] = value
                    if entry:
                        state[position] = entry
                    params.append(position)
                    position += 1
            groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": params})
        optimizer.load_state_dict({"state": state, "param_groups": groups})


def _check_parameters(engine: ShardedEngine, saved: set[str], exact: bool) -> None:
    """The module's trained parameters must all be in the checkpoint (and, for a sharded one,
    nothing else: an ordinary state_dict also holds buffers and frozen parameters)."""
    current = {slot.name for b in engine.buckets for slot in b.layout.slots}
    missing, unexpected = sorted(current - saved), sorted(saved - current)
    if missing or (exact and unexpected):
        raise ValueError(
            f"the checkpoint's trained parameters do not match the module's: missing {missing[:8]}, "
            f"unexpected {unexpected[:8]}"
        )


def full_state_from_lightning(checkpoint: dict[str, Any], param_names: list[list[list[str]]]) -> dict[str, Any]:
    """The full state of an ordinary (single-file) checkpoint: its state_dict as masters and
    weights, and its optimizer states re-keyed from parameter indices to names."""
    state_dict = checkpoint["state_dict"]
    optimizers = []
    for saved, groups in zip(checkpoint.get("optimizer_states", []), param_names, strict=False):
        names = [name for group in groups for name in group]
        optimizers.append(
            {"param_groups": saved["param_groups"], "state": {names[i]: v for i, v in saved["state"].items()}}
        )
    return {
        "masters": {k: v.float() for k, v in state_dict.items()},
        "weights": dict(state_dict),
        "optimizers": optimizers,
        "optimizer_param_names": param_names,
    }


def consolidate_checkpoint(path: str | os.PathLike, output: str | os.PathLike | None = None) -> dict[str, Any]:
    """Turn a sharded checkpoint directory into one ordinary Lightning checkpoint dict.

    Its "state_dict" (fp32 master weights plus buffers) loads into the plain LightningModule,
    and its "optimizer_states" are per-parameter, in the optimizers' own parameter order, so
    that another strategy can resume from it. Written to `output` when given.
    """
    meta = read_meta(Path(path))
    full = read_full_state(path)
    state_dict = {**meta["untrained_state"], **full["masters"]}
    optimizer_states = []
    for saved, groups in zip(full["optimizers"], meta["optimizer_param_names"], strict=True):
        names = [name for group in groups for name in group]
        state = {}
        for index, name in enumerate(names):
            shape = full["masters"][name].shape
            entries = saved["state"].get(name)
            if entries:
                state[index] = {
                    k: v.view(shape) if isinstance(v, Tensor) and v.dim() > 0 else v for k, v in entries.items()
                }
        param_groups, position = [], 0
        for saved_group, group_names in zip(saved["param_groups"], groups, strict=True):
            ids = list(range(position, position + len(group_names)))
            position += len(group_names)
            param_groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": ids})
        optimizer_states.append({"state": state, "param_groups": param_groups})
    checkpoint = {**meta["lightning"], "state_dict": state_dict, "optimizer_states": optimizer_states}
    if output is not None:
        _atomic_save(checkpoint, Path(output))
    return checkpoint
