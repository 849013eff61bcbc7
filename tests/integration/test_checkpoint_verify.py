"""Damaged or misplaced shards are refused, naming the file, on 2 ranks:
- 16 flipped bytes in one shard, swapped shard files (also with their manifest records swapped,
  so that only the rank stored inside each shard tells), a truncated shard, a missing manifest,
  a missing meta.pt, one rank's failure to read, and a checkpoint of a different-width model:
  each raises one CheckpointError (a ValueError) with the same message on every rank, naming the
  rank, the file and what is wrong, and leaves the engine's weights, masters and optimizer state
  exactly as they were;
- resharding (another bucket size) verifies every shard, and so does consolidate_checkpoint;
- under the Trainer, fit(ckpt_path=...) on a damaged shard or a folder without a manifest raises
  that CheckpointError on both ranks (not a peer's socket error, not IsADirectoryError);
- is_sharded_checkpoint is False for a folder whose shards were partly deleted.
"""

import shutil
from pathlib import Path

import torch
from checkpoint_helpers import make_engine, same, snapshot, train_step
from distributed import run_workers
from lightning_runs import make_trainer, sdp4bit
from models import TinyLMModule


def _flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    file.write_bytes(bytes(data))


def _swap(a: Path, b: Path) -> None:
    temporary = a.with_name("swap.tmp")
    a.rename(temporary)
    b.rename(a)
    temporary.rename(b)


def _swap_with_manifest(path: Path) -> None:
    from dataclasses import replace

    from lightning_sdp4bit.checkpoint.files import read_manifest, write_manifest

    gen = path / "gen_000000"
    _swap(gen / "shard_00000.pt", gen / "shard_00001.pt")
    manifest = read_manifest(path)
    files = dict(manifest.files)
    zero, one = files["shard_00000.pt"], files["shard_00001.pt"]
    files["shard_00000.pt"] = replace(one, rank=0)
    files["shard_00001.pt"] = replace(zero, rank=1)
    write_manifest(path, replace(manifest, files=files))


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


DAMAGES = {
    "flipped": lambda p: _flip(p / "gen_000000" / "shard_00001.pt"),
    "swapped": lambda p: _swap(p / "gen_000000" / "shard_00000.pt", p / "gen_000000" / "shard_00001.pt"),
    "swapped-with-manifest": _swap_with_manifest,
    "truncated": lambda p: _truncate(p / "gen_000000" / "shard_00000.pt"),
    "no-manifest": lambda p: (p / "manifest.json").unlink(),
    "no-meta": lambda p: (p / "gen_000000" / "meta.pt").unlink(),
}


def _refusals(rank, world, directory):
    from lightning_sdp4bit.checkpoint import (
        CheckpointError,
        consolidate_checkpoint,
        is_sharded_checkpoint,
        load_sharded,
        save_sharded,
    )

    directory = Path(directory)
    good = directory / "good.ckpt"
    engine, optimizer = make_engine(rank, world)
    train_step(engine, optimizer, seed=1)
    save_sharded(engine, [optimizer], {}, good, torch.distributed.barrier)
    train_step(engine, optimizer, seed=2)  # the engine now differs from the checkpoint

    def attempt(engine, optimizer, path):
        before = snapshot(engine, optimizer)
        try:
            load_sharded(engine, [optimizer], path)
            message = None
        except CheckpointError as error:
            message = str(error)
        return message, same(snapshot(engine, optimizer), before)

    out = {}
    for name, damage in DAMAGES.items():
        path = directory / f"{name}.ckpt"
        if rank == 0:
            shutil.copytree(good, path)
            damage(path)
        torch.distributed.barrier()
        out[name] = attempt(engine, optimizer, path)
        out[f"{name}/complete"] = is_sharded_checkpoint(path)
        if rank == 0:
            try:
                consolidate_checkpoint(path)
                out[f"{name}/consolidate"] = None
            except CheckpointError as error:
                out[f"{name}/consolidate"] = str(error)
        torch.distributed.barrier()

    # One rank that cannot read its shard (here: torch.load fails on rank 1 only).
    original = torch.load
    if rank == 1:
        torch.load = lambda *args, **kwargs: (_ for _ in ()).throw(OSError("Input/output error"))
    out["unreadable-on-rank-1"] = attempt(engine, optimizer, good)
    torch.load = original

    wider, wider_optimizer = make_engine(rank, world, width=48)
    out["wider"] = attempt(wider, wider_optimizer, good)
    resharded, resharded_optimizer = make_engine(rank, world, bucket_numel=5000)
    out["resharded-flipped"] = attempt(resharded, resharded_optimizer, directory / "flipped.ckpt")
    out["good"] = attempt(engine, optimizer, good)
    return out


def test_damaged_or_misplaced_shards_are_refused_on_every_rank_naming_the_file(tmp_path):
    results = run_workers(_refusals, 2, str(tmp_path))
    expected = {
        "flipped": "rank 1: {d}/flipped.ckpt/gen_000000/shard_00001.pt: checksum mismatch",
        "swapped": "on every rank: {d}/swapped.ckpt/gen_000000/shard_00000.pt holds rank 1's shard",
        "swapped-with-manifest": "shard_00000.pt holds rank 1's shard, not rank 0's",
        "truncated": "on every rank: {d}/truncated.ckpt/gen_000000/shard_00000.pt truncated: ",
        "no-manifest": "on every rank: {d}/no-manifest.ckpt: manifest.json missing: not a complete sdp4bit checkpoint",
        "no-meta": "on every rank: {d}/no-meta.ckpt/gen_000000/meta.pt missing: not a complete sdp4bit checkpoint",
        "unreadable-on-rank-1": "rank 1: {d}/good.ckpt/gen_000000/meta.pt: unreadable (OSError: Input/output error)",
        "wider": "parameter blocks.0.mlp.2.weight: shape (32, 64) in the checkpoint, (48, 96) in the module",
        "resharded-flipped": "on every rank: {d}/flipped.ckpt/gen_000000/shard_00001.pt: checksum mismatch",
    }
    for case, text in expected.items():
        text = text.format(d=tmp_path)
        messages = [r[case][0] for r in results]
        assert messages[0] is not None and text in messages[0], (case, messages[0])
        assert messages[1] == messages[0], case  # the same error on every rank
        assert all(r[case][1] for r in results), f"{case}: the engine changed before the checks passed"
    assert results[0]["good"] == (None, False)  # the good checkpoint loads (and changes the engine)
    # Consolidation verifies every shard too.
    assert "shard_00001.pt: checksum mismatch" in results[0]["flipped/consolidate"]
    assert "shard_00000.pt holds rank 1's shard" in results[0]["swapped/consolidate"]
    assert "manifest.json missing" in results[0]["no-manifest/consolidate"]
    # Complete = every listed file present with its recorded size; the bytes inside are for loading to check.
    complete = {case for case in DAMAGES if results[0][f"{case}/complete"]}
    assert complete == {"flipped", "swapped-with-manifest"}


def _fit_from(world, path):
    from lightning_sdp4bit.checkpoint import CheckpointError

    module = TinyLMModule(dataset_size=1, repeat=32)
    try:
        make_trainer(world, sdp4bit(), max_steps=1).fit(module, ckpt_path=path)
    except CheckpointError as error:
        return str(error)
    return None


def _fits_from_damaged(rank, world, directory):
    module = TinyLMModule(dataset_size=1, repeat=32)
    trainer = make_trainer(world, sdp4bit(), max_steps=1)
    trainer.fit(module)
    trainer.save_checkpoint(f"{directory}/flipped.ckpt")
    if rank == 0:
        _flip(Path(directory) / "flipped.ckpt" / "gen_000000" / "shard_00001.pt")
        (Path(directory) / "no-manifest.ckpt").mkdir()
    torch.distributed.barrier()
    return [_fit_from(world, f"{directory}/{case}.ckpt") for case in ("flipped", "no-manifest")]


def test_fit_from_a_damaged_checkpoint_raises_one_clear_error_on_every_rank(tmp_path):
    flipped, no_manifest = zip(*run_workers(_fits_from_damaged, 2, str(tmp_path)))
    text = f"rank 1: {tmp_path}/flipped.ckpt/gen_000000/shard_00001.pt: checksum mismatch"
    assert flipped[0] is not None and text in flipped[0] and flipped[1] == flipped[0]
    text = f"on every rank: {tmp_path}/no-manifest.ckpt: manifest.json missing: not a complete sdp4bit checkpoint"
    assert no_manifest[0] is not None and text in no_manifest[0] and no_manifest[1] == no_manifest[0]
