"""A resume that changes something says so, on 2 ranks:
- an AdamW checkpoint loaded into an engine whose optimizer is SGD is refused, on every rank and
  with the engine untouched, naming both classes: with the layout it was saved with and
  resharded. An ordinary (consolidated) file names no class: it is refused naming the options
  SGD needs that its parameter groups lack. Before, it loaded and SGD's first step raised
  `KeyError: 'momentum'`;
- a checkpoint saved under the sdp4bit preset and loaded under baseline's compression loads
  exactly, with one warning on rank 0 that lists the fields that differ (before: silently);
- a checkpoint whose manifest was rebuilt by hand around the shard of another save (another
  step, its checksums recomputed) is refused by load_sharded (same layout and resharded) and
  consolidate_checkpoint, naming the shard and both steps (before: it loaded silently).
"""

import shutil
import warnings
from dataclasses import replace
from pathlib import Path

import torch
from checkpoint_helpers import make_engine, same, snapshot, train_step
from distributed import run_workers


def _attempt(engine, optimizer, load):
    """(the CheckpointError `load()` raised or None, whether the engine stayed as it was)."""
    from lightning_sdp4bit.checkpoint import CheckpointError

    before = snapshot(engine, optimizer)
    try:
        load()
        message = None
    except CheckpointError as error:
        message = str(error)
    return message, same(snapshot(engine, optimizer), before)


def _optimizer_changes(rank, world, directory):
    from lightning_sdp4bit.checkpoint import (
        consolidate_checkpoint,
        full_state_from_lightning,
        load_full_state,
        load_sharded,
        save_sharded,
    )

    path = Path(directory) / "adamw.ckpt"
    engine, adamw = make_engine(rank, world)
    train_step(engine, adamw, seed=1)
    save_sharded(engine, [adamw], {}, path, torch.distributed.barrier)
    if rank == 0:
        consolidate_checkpoint(path, Path(directory) / "adamw-plain.ckpt")
    torch.distributed.barrier()
    plain = torch.load(Path(directory) / "adamw-plain.ckpt", weights_only=True)
    out = {}
    for name, config in (("same layout", {}), ("resharded", {"bucket_numel": 5000})):
        engine, sgd = make_engine(rank, world, optimizer_class=torch.optim.SGD, **config)
        out[name] = _attempt(engine, sgd, lambda e=engine, o=sgd: load_sharded(e, [o], path))
    engine, sgd = make_engine(rank, world, optimizer_class=torch.optim.SGD)
    full = full_state_from_lightning(plain, engine.optimizer_param_names)
    out["ordinary"] = _attempt(engine, sgd, lambda: load_full_state(engine, [sgd], full))
    return out


def test_another_optimizer_class_is_refused_naming_both(tmp_path):
    results = run_workers(_optimizer_changes, 2, str(tmp_path))
    for out in results:
        for case in ("same layout", "resharded"):
            message, unchanged = out[case]
            assert unchanged and message is not None, case
            assert (
                "optimizer 0: the checkpoint holds the state of torch.optim.adamw.AdamW, the module's optimizer "
                "is torch.optim.sgd.SGD" in message
            ), message
            assert message == results[0][case][0]  # every rank
        message, unchanged = out["ordinary"]
        assert unchanged and message is not None
        assert "optimizer 0 (torch.optim.sgd.SGD) needs the parameter-group options ['dampening', 'momentum']" in (
            message
        ), message


def _config_change(rank, world, directory):
    from lightning_sdp4bit.checkpoint import load_sharded, save_sharded

    path = Path(directory) / "sdp4bit.ckpt"
    engine, optimizer = make_engine(rank, world)
    train_step(engine, optimizer, seed=1)
    save_sharded(engine, [optimizer], {}, path, torch.distributed.barrier)
    caught = {"saved": _masters(engine)}
    for name, config in (("same", {}), ("baseline", {"weight_quant": "none", "grad_quant": "none"})):
        engine, optimizer = make_engine(rank, world, **config)
        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            load_sharded(engine, [optimizer], path)
        caught[name] = [str(r.message) for r in records if "another SDP4BitConfig" in str(r.message)]
        caught[f"{name} masters"] = _masters(engine)
    return caught


def _masters(engine):
    """{(parameter, first element): this rank's fp32 master fragment of it}."""
    return {
        (r.fragment.name, r.fragment.param_start): r.master.clone()
        for records in engine.fragments_by_name.values()
        for r in records
    }


def _full(pieces_per_rank):
    """{parameter: its whole master, flat}, from every rank's fragments (layouts may differ)."""
    parts = {}
    for pieces in pieces_per_rank:
        for (name, start), values in pieces.items():
            parts.setdefault(name, {})[start] = values
    return {name: torch.cat([p[s] for s in sorted(p)]) for name, p in parts.items()}


def test_another_config_loads_exactly_and_says_what_changed(tmp_path):
    results = run_workers(_config_change, 2, str(tmp_path))
    saved = _full([caught["saved"] for caught in results])
    for name in ("same", "baseline"):  # another layout under baseline (no compression alignment)
        loaded = _full([caught[f"{name} masters"] for caught in results])
        assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved), name
    for rank, caught in enumerate(results):
        assert caught["same"] == [] and len(caught["baseline"]) == (1 if rank == 0 else 0)
    message = results[0]["baseline"][0]
    assert f"{tmp_path}/sdp4bit.ckpt was saved with another SDP4BitConfig: " in message
    assert "weight_quant 'diff' -> 'none'" in message and "grad_quant 'two_level' -> 'none'" in message
    assert "weight_bits" not in message  # unchanged fields are not listed


def _mixed_steps(rank, world, directory):
    from lightning_sdp4bit.checkpoint import consolidate_checkpoint, load_sharded, save_sharded
    from lightning_sdp4bit.checkpoint.files import read_manifest, write_manifest

    directory = Path(directory)
    engine, optimizer = make_engine(rank, world)
    train_step(engine, optimizer, seed=1)
    save_sharded(engine, [optimizer], {}, directory / "step1.ckpt", torch.distributed.barrier)
    train_step(engine, optimizer, seed=2)
    save_sharded(engine, [optimizer], {}, directory / "step2.ckpt", torch.distributed.barrier)
    mixed = directory / "mixed.ckpt"
    if rank == 0:  # step 2's checkpoint, with step 1's shard of rank 1 and its manifest record
        shutil.copytree(directory / "step2.ckpt", mixed)
        name = "shard_00001.pt"
        shutil.copyfile(directory / "step1.ckpt" / "gen_000000" / name, mixed / "gen_000000" / name)
        manifest = read_manifest(mixed)
        record = read_manifest(directory / "step1.ckpt").files[name]
        write_manifest(mixed, replace(manifest, files={**manifest.files, name: record}))
    torch.distributed.barrier()
    out = {"same layout": _attempt(engine, optimizer, lambda: load_sharded(engine, [optimizer], mixed))}
    resharded, resharded_optimizer = make_engine(rank, world, bucket_numel=5000)
    out["resharded"] = _attempt(
        resharded, resharded_optimizer, lambda: load_sharded(resharded, [resharded_optimizer], mixed)
    )
    if rank == 0:
        out["consolidate"] = _attempt(engine, optimizer, lambda: consolidate_checkpoint(mixed))
    return out


def test_shards_of_different_saves_are_refused(tmp_path):
    results = run_workers(_mixed_steps, 2, str(tmp_path))
    shard = f"{tmp_path}/mixed.ckpt/gen_000000/shard_00001.pt was saved at step 1, meta.pt at step 2"
    for out in results:
        for case, (message, unchanged) in out.items():
            assert unchanged and message is not None and shard in message, (case, message)
        assert out["same layout"][0].startswith("rank 1: ")  # only rank 1 reads that shard; both raise
        assert out["same layout"][0] == results[0]["same layout"][0]
