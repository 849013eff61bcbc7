"""Loading a sharded checkpoint into a running engine, on the world size it was saved with or on
any other, and loading an ordinary single-file checkpoint through the same full state.

Every load first checks, then modifies: the manifest and the files it lists (sizes, XXH3-64
checksums, each shard's rank and tensors), and the module's parameter names and shapes against the
checkpoint's. Under a process group the ranks then agree (`files.agree`), so that one rank's
failure raises the same CheckpointError everywhere, before anything in the module, the engine or
the optimizers has changed.

Every file is read without running code (`unpickling`): the shards with weights_only=True, meta.pt
with Lightning's `weights_only` argument (None: torch's default, True).

Loading with the layout it was saved with reads one shard per rank. Otherwise (another world
size, bucket size or alignment) every rank reads all shards, rebuilds each parameter's full
master weights, weights and elementwise optimizer state by name (the **full state**), and cuts
its own fragments out of it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor

from lightning_sdp4bit.checkpoint.changes import check_optimizer, check_step, warn_config_changes
from lightning_sdp4bit.checkpoint.files import (
    META,
    CheckpointError,
    Manifest,
    agree,
    check_complete,
    check_shard,
    describe,
    is_sharded_checkpoint,
    read_manifest,
    shard_file,
    sibling,
    verify_file,
)
from lightning_sdp4bit.checkpoint.save import fragment_map, layout_record
from lightning_sdp4bit.checkpoint.unpickling import META_OPT_OUT, load_restricted
from lightning_sdp4bit.engine import ShardedEngine

__all__ = [
    "check_state_dict",
    "complete_partial",
    "find_checkpoint",
    "full_state_from_lightning",
    "load_full_state",
    "load_sharded",
    "read_full_state",
    "read_meta",
]


def complete_partial(path: str | os.PathLike) -> Path | None:
    """Where nothing is at `path`, the complete `path.partial` an interrupted save left there (a
    crash after its commit, before its last rename); otherwise None."""
    path = Path(path)
    partial = sibling(path, ".partial")
    return partial if not path.exists() and is_sharded_checkpoint(partial) else None


def find_checkpoint(path: str | os.PathLike) -> Path:
    """`path`; or, where an interrupted save left nothing there, the complete `path.partial` it
    had written (with a warning that names it)."""
    path = Path(path)
    partial = complete_partial(path)
    if partial is not None:
        warnings.warn(
            f"{path} does not exist: loading {partial}, the complete checkpoint of a save that was interrupted "
            "just before its last rename (the next save to this path moves it into place)",
            stacklevel=2,
        )
        return partial
    return path


# How many times a reader starts over on a newer manifest before it gives up (a writer that
# commits faster than the checkpoint can be read).
_READ_ATTEMPTS = 5
T = TypeVar("T")


def _consistently(path: Path, read: Callable[[Manifest], T]) -> T:
    """`read(manifest)`, started over on the newer manifest when a save committed one meanwhile.

    A save removes the generation it replaced right after its commit, so the files an older
    manifest lists can vanish under a reader (seen as a missing file). Committed files are never
    changed in place, so a failure with the same manifest still in place is the checkpoint's own.
    """
    for _ in range(_READ_ATTEMPTS):
        manifest = read_manifest(path)
        try:
            return read(manifest)
        except (CheckpointError, OSError):
            if _generation(path) == manifest.generation:
                raise
    raise CheckpointError(
        f"{path}: a save committed a new generation during each of {_READ_ATTEMPTS} attempts to read it"
    )


def _generation(path: Path) -> str | None:
    try:
        return read_manifest(path).generation
    except CheckpointError:
        return None


def _meta(path: Path, manifest: Manifest, weights_only: bool | None) -> dict[str, Any]:
    """meta.pt, verified, with the generation it was read from under "generation"."""
    check_complete(path, manifest)
    meta = load_restricted(verify_file(path, manifest, META), weights_only, META_OPT_OUT)
    return {**meta, "generation": manifest.generation}


def read_meta(
    path: str | os.PathLike, *, collective: bool = False, timeouts: Any = None, weights_only: bool | None = None
) -> dict[str, Any]:
    """The verified meta.pt of a complete sharded checkpoint (no tensors of the model's size),
    with the generation it was read from under "generation" (for `load_sharded`). With
    `collective=True` every rank of the default process group calls it and all of them raise the
    same CheckpointError if any rank could not read it (`timeouts`: see `agree`). `weights_only`:
    Lightning's argument, for meta.pt (see `unpickling`)."""
    if not collective:
        path = find_checkpoint(path)
        return _consistently(path, lambda manifest: _meta(path, manifest, weights_only))
    meta, error = None, None
    try:
        found = find_checkpoint(path)
        meta = _consistently(found, lambda manifest: _meta(found, manifest, weights_only))
    except Exception as caught:
        error = describe(caught)
    agree(error, timeouts=timeouts)
    assert meta is not None  # agree raised on every rank otherwise
    return meta


def load_sharded(
    engine: ShardedEngine,
    optimizers: list[torch.optim.Optimizer] | None,
    path: str | os.PathLike,
    generation: str | None = None,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Restore masters, weights, the engine's step and (if `optimizers` is given) optimizer
    state from a sharded checkpoint into a running engine. Returns the meta dict (Lightning's
    part under "lightning"). Collective: every rank calls it. Raises CheckpointError on every
    rank, with nothing modified, if any rank finds the checkpoint incomplete, damaged,
    misplaced or made for another model. `generation`: the one an earlier `read_meta` gave
    (meta["generation"]), which the shards must come from (another job may have saved since).
    `weights_only`: Lightning's argument, for meta.pt (see `unpickling`)."""
    path = find_checkpoint(path)
    rank = engine.topology.rank

    def read(manifest: Manifest) -> tuple[str, dict[str, Any], Any, Any]:
        """(generation, meta, this rank's shard or None, the full state or None), checked."""
        if generation is not None and manifest.generation != generation:
            raise CheckpointError(
                f"{path} changed while it was loaded: meta.pt was read from {generation}, the shards would come "
                f"from {manifest.generation} (another job saved to it meanwhile); load it again"
            )
        meta = _meta(path, manifest, weights_only)
        check_parameters(engine, {name: shape for name, (shape, _) in manifest.parameters.items()}, exact=True)
        check_state_dict(engine.module, meta["untrained_state"], strict=False)
        if meta["world_size"] == engine.topology.world_size and meta["layout"] == layout_record(engine):
            name = shard_file(rank)
            file = verify_file(path, manifest, name)
            shard = load_restricted(file)
            check_shard(file, shard, manifest.files[name])
            check_step(file, shard, meta)
            if optimizers is not None:
                _check_same_layout_optimizers(engine, optimizers, shard, file, meta.get("optimizer_classes"))
            return manifest.generation, meta, shard, None
        full = _read_full_state(path, manifest, meta)
        _check_full_state(engine, optimizers, full)
        return manifest.generation, meta, None, full

    found, shard, full, error = None, None, None, None
    try:
        found, meta, shard, full = _consistently(path, read)
    except Exception as caught:
        error = describe(caught)
    generations = agree(error, found, engine.groups.world, engine.timeouts)
    if len(set(generations)) > 1:
        # A save committed between the ranks' reads: the ranks would resume different states.
        raise CheckpointError(
            f"{path} changed while it was loaded (the ranks read generations {sorted(set(generations))}): "
            "another job saved to it meanwhile; load it again"
        )

    if shard is not None:
        with torch.no_grad():
            for bucket, saved in zip(engine.buckets, shard["buckets"], strict=True):
                bucket.master.copy_(saved["master"])
                bucket.weight_shard.copy_(saved["weights"])
        engine.gather_weight_shards()
        for optimizer, state in zip(optimizers or [], shard["optimizers"], strict=False):
            optimizer.load_state_dict(state)
    else:
        assert full is not None  # read() returns this rank's shard or the full state
        _apply_full_state(engine, optimizers, full)
    if rank == 0:
        warn_config_changes(path, meta["config"], engine.config.to_dict())
    engine.restore_step(int(meta["engine_step"]))
    engine.meter.load_state_dict(meta["meter"])
    # Checkpoints from before the count was saved: their skipped steps are unknown, counted from 0.
    engine.skipped.restore(int(meta.get("skipped_steps", 0)))
    return meta


def _check_same_layout_optimizers(
    engine: ShardedEngine,
    optimizers: list[torch.optim.Optimizer],
    shard: dict[str, Any],
    file: Path,
    classes: list[str] | None,
) -> None:
    if len(shard["optimizers"]) != len(optimizers):
        raise CheckpointError(
            f"{file}: holds {len(shard['optimizers'])} optimizer states, the module has {len(optimizers)}"
        )
    if shard["fragments"] != [fragment_map(engine, i) for i in range(len(optimizers))]:
        raise CheckpointError(f"{file}: the optimizers' parameters differ from those the checkpoint was saved with")
    for index, (optimizer, state) in enumerate(zip(optimizers, shard["optimizers"], strict=True)):
        check_optimizer(index, optimizer, state["param_groups"], classes[index] if classes else None)
        saved = [len(g["params"]) for g in state["param_groups"]]
        if saved != [len(g["params"]) for g in optimizer.param_groups]:
            raise CheckpointError(f"{file}: optimizer {index}'s parameter groups differ from the checkpoint's")


def read_full_state(path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
    """Every parameter's full master weights, model weights and optimizer state, by name, from
    all shards of a sharded checkpoint (the memory of the whole model's training state), each
    file verified. Not collective. `weights_only`: Lightning's argument, for meta.pt."""
    path = find_checkpoint(path)
    return _consistently(path, lambda manifest: _read_full_state(path, manifest, _meta(path, manifest, weights_only)))


def _read_full_state(path: Path, manifest: Manifest, meta: dict[str, Any]) -> dict[str, Any]:
    shapes = {name: shape for bucket in meta["layout"] for name, shape, _ in bucket["slots"]}
    masters = {name: torch.empty(shape, dtype=torch.float32).view(-1) for name, shape in shapes.items()}
    weights: dict[str, Tensor] = {}
    optimizers: list[dict[str, Any]] = []
    for rank in range(meta["world_size"]):
        name = shard_file(rank)
        file = verify_file(path, manifest, name)
        shard = load_restricted(file)
        check_shard(file, shard, manifest.files[name])
        check_step(file, shard, meta)
        for bucket_meta, saved in zip(meta["layout"], shard["buckets"], strict=True):
            lo = rank * bucket_meta["shard_numel"]
            for slot_name, shape, start in bucket_meta["slots"]:
                numel = int(torch.Size(shape).numel())
                a, b = max(lo, start), min(lo + bucket_meta["shard_numel"], start + numel)
                if a < b:
                    masters[slot_name][a - start : b - start] = saved["master"][a - lo : b - lo]
                    target = weights.setdefault(slot_name, torch.empty(numel, dtype=bucket_meta["dtype"]))
                    target[a - start : b - start] = saved["weights"][a - lo : b - lo]
        for index, (state_dict, fragments) in enumerate(zip(shard["optimizers"], shard["fragments"], strict=True)):
            if len(optimizers) <= index:
                optimizers.append({"param_groups": state_dict["param_groups"], "state": {}})
            _merge_fragment_states(optimizers[index]["state"], state_dict["state"], fragments, shapes)
    return {
        "meta": meta,  # of the same generation
        "masters": {name: t.view(shapes[name]) for name, t in masters.items()},
        "weights": {name: t.view(shapes[name]) for name, t in weights.items()},
        "optimizers": optimizers,
        "optimizer_param_names": meta["optimizer_param_names"],
        "optimizer_classes": meta.get("optimizer_classes"),  # None before they were recorded
    }


def _merge_fragment_states(full: dict, states: dict, fragments: list, shapes: dict) -> None:
    for index, (name, start, numel) in enumerate(fragments):
        for key, value in states.get(index, {}).items():
            slot = full.setdefault(name, {})
            if isinstance(value, Tensor) and value.dim() > 0:
                if value.numel() != numel:
                    raise CheckpointError(
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
    """Cut this rank's masters, weights and optimizer fragments out of a full state, after
    checking it against the module and the optimizers (CheckpointError, nothing modified)."""
    _check_full_state(engine, optimizers, full)
    _apply_full_state(engine, optimizers, full)


def _check_full_state(
    engine: ShardedEngine, optimizers: list[torch.optim.Optimizer] | None, full: dict[str, Any]
) -> None:
    check_parameters(engine, {name: tuple(t.shape) for name, t in full["masters"].items()}, exact=False)
    if optimizers is None:
        return
    if len(full["optimizers"]) != len(optimizers):
        raise CheckpointError(
            f"the checkpoint holds {len(full['optimizers'])} optimizer states, the module has {len(optimizers)}"
        )
    classes = full.get("optimizer_classes")
    for index, saved in enumerate(full["optimizers"]):
        check_optimizer(index, optimizers[index], saved["param_groups"], classes[index] if classes else None)
        groups, current = full["optimizer_param_names"][index], engine.optimizer_param_names[index]
        if [len(g) for g in groups] != [len(g) for g in current] or len(saved["param_groups"]) != len(current):
            raise CheckpointError(f"optimizer {index}'s parameter groups differ from those in the checkpoint")
        for name, entries in saved["state"].items():
            numel = full["masters"][name].numel() if name in full["masters"] else None
            for key, value in entries.items():
                if isinstance(value, Tensor) and value.dim() > 0 and value.numel() != numel:
                    raise CheckpointError(
                        f"optimizer {index}'s state {key!r} of {name!r} has {value.numel()} elements, "
                        f"the parameter {numel}"
                    )


def _apply_full_state(
    engine: ShardedEngine, optimizers: list[torch.optim.Optimizer] | None, full: dict[str, Any]
) -> None:
    engine.before_weights_load()
    with torch.no_grad():
        for bucket in engine.buckets:
            # Straight into the weights this rank holds (with weight_sharding="node", its node
            # slices: no bucket is gathered whole to be written).
            for position, start, values in bucket.held_pieces():
                slot = bucket.layout.slots[position]
                source = full["weights"].get(slot.name, full["masters"][slot.name]).reshape(-1)
                values.copy_(source[start : start + values.numel()])
            for frag in bucket.layout.fragments(engine.topology.rank):
                source = full["masters"][frag.name].reshape(-1)[frag.param_start : frag.param_start + frag.numel]
                bucket.master[frag.shard_start : frag.shard_start + frag.numel].copy_(source)
    # The loaded weights are the reference for in-place edit checks, not an edit of the masters.
    engine.weights_loaded()
    for index, (optimizer, saved) in enumerate(zip(optimizers or [], full["optimizers"], strict=False)):
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


def check_parameters(engine: ShardedEngine, saved: dict[str, tuple[int, ...]], exact: bool) -> None:
    """The module's trained parameters must all be in the checkpoint with their shapes (and, for
    a sharded one, nothing else: an ordinary state_dict also holds buffers and frozen parameters)."""
    current = {slot.name: tuple(slot.shape) for b in engine.buckets for slot in b.layout.slots}
    missing, unexpected = sorted(current.keys() - saved.keys()), sorted(saved.keys() - current.keys())
    if missing or (exact and unexpected):
        raise CheckpointError(
            f"the checkpoint's trained parameters do not match the module's: missing {missing[:8]}, "
            f"unexpected {unexpected[:8]}"
        )
    _check_shapes({name: saved[name] for name in current}, current)


def check_state_dict(module: torch.nn.Module, state_dict: dict[str, Any], strict: bool) -> None:
    """What module.load_state_dict would refuse, refused before it copies anything: with `strict`,
    missing or unexpected keys; always, a tensor whose shape differs from the module's."""
    # keep_vars: names and shapes only; detach() would read (gather) a released parameter.
    current = module.state_dict(keep_vars=True)
    if strict:
        missing, unexpected = sorted(current.keys() - state_dict.keys()), sorted(state_dict.keys() - current.keys())
        if missing or unexpected:
            raise CheckpointError(
                f"the checkpoint's state_dict does not match the module's: missing {missing[:8]}, "
                f"unexpected {unexpected[:8]}"
            )
    _check_shapes(
        {k: tuple(v.shape) for k, v in state_dict.items() if k in current and isinstance(v, Tensor)},
        {k: tuple(v.shape) for k, v in current.items()},
    )


def _check_shapes(saved: dict[str, tuple[int, ...]], current: dict[str, tuple[int, ...]]) -> None:
    wrong = [
        f"parameter {name}: shape {tuple(shape)} in the checkpoint, {current[name]} in the module"
        for name, shape in saved.items()
        if tuple(shape) != current[name]
    ]
    if wrong:
        more = f" (and {len(wrong) - 4} more)" if len(wrong) > 4 else ""
        raise CheckpointError("; ".join(wrong[:4]) + more)


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
