"""Checkpoints of earlier versions, on 2 ranks. The two older on-disk formats are made from a
current checkpoint exactly as those versions wrote them (read from commits fb00191 and cbe2b83):
sharded-v1 (meta.pt and the shards at the top, no manifest) and sharded-v2 with a CRC-32 manifest.
Loading either raises one CheckpointError on every rank that names the format it found and gives
the command that converts it; after `python -m lightning_sdp4bit.checkpoint.upgrade` both load bit
for bit as the state that was saved. A damaged v1 shard is refused by the converter, which leaves
the checkpoint as it was.
"""

import json
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import torch
from checkpoint_helpers import make_engine, same, snapshot, train_step
from distributed import run_workers

COMMAND = "python -m lightning_sdp4bit.checkpoint.upgrade"


def _as_v1(current: Path, old: Path) -> None:
    """fb00191's layout: meta.pt (format sharded-v1, no skipped-step count) and shards at the top."""
    old.mkdir()
    for file in (current / "gen_000000").iterdir():
        shutil.copyfile(file, old / file.name)
    meta = torch.load(old / "meta.pt", weights_only=False)
    meta["format"] = "lightning-sdp4bit/sharded-v1"
    del meta["skipped_steps"]
    torch.save(meta, old / "meta.pt")


def _as_crc32(current: Path, old: Path) -> None:
    """cbe2b83's manifest: "crc32" per file and "manifest_crc32" over the body."""
    shutil.copytree(current, old)
    body = json.loads((old / "manifest.json").read_text())
    del body["manifest_xxh3_64"]
    for name, record in body["files"].items():
        del record["xxh3_64"]
        record["crc32"] = zlib.crc32((old / body["generation"] / name).read_bytes())
    body["manifest_crc32"] = zlib.crc32(json.dumps(body, sort_keys=True).encode())
    (old / "manifest.json").write_text(json.dumps(body, indent=1, sort_keys=True))


def _upgrade(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lightning_sdp4bit.checkpoint.upgrade", *map(str, paths)], capture_output=True, text=True
    )


def _older_formats(rank, world, directory):
    from lightning_sdp4bit.checkpoint import CheckpointError, load_sharded, save_sharded

    directory = Path(directory)
    engine, optimizer = make_engine(rank, world)
    train_step(engine, optimizer, seed=1)
    save_sharded(engine, [optimizer], {}, directory / "current.ckpt", torch.distributed.barrier)
    saved = snapshot(engine, optimizer)
    olds = {"v1": directory / "v1.ckpt", "crc32": directory / "crc32.ckpt", "damaged": directory / "damaged.ckpt"}
    if rank == 0:
        _as_v1(directory / "current.ckpt", olds["v1"])
        _as_crc32(directory / "current.ckpt", olds["crc32"])
        _as_v1(directory / "current.ckpt", olds["damaged"])
        (olds["damaged"] / "shard_00001.pt").write_bytes(b"not a shard")
    torch.distributed.barrier()
    train_step(engine, optimizer, seed=2)
    refusals = {}
    for name in ("v1", "crc32"):
        try:
            load_sharded(engine, [optimizer], olds[name])
        except CheckpointError as error:
            refusals[name] = str(error)
    converted = None
    if rank == 0:
        converted = _upgrade(olds["v1"], olds["crc32"]), _upgrade(olds["damaged"]), _upgrade(olds["v1"])
        converted = [(c.returncode, c.stdout + c.stderr) for c in converted]
    torch.distributed.barrier()
    loaded = {}
    for name in ("v1", "crc32"):
        load_sharded(engine, [optimizer], olds[name])
        loaded[name] = same(snapshot(engine, optimizer), saved)
    listing = sorted(p.name for p in olds["v1"].iterdir())
    damaged = sorted(p.name for p in olds["damaged"].iterdir())
    return refusals, converted, loaded, listing, damaged


def test_older_formats_are_named_with_the_command_that_converts_them(tmp_path):
    results = run_workers(_older_formats, 2, str(tmp_path))
    for refusals, _, loaded, listing, damaged in results:
        assert refusals == results[0][0]  # the same error on every rank
        assert "format, sharded-v1 (meta.pt and shards at the top, no manifest" in refusals["v1"]
        assert "format, sharded-v2 with a CRC-32 manifest" in refusals["crc32"]
        for name in ("v1", "crc32"):
            assert f"{COMMAND} {tmp_path / f'{name}.ckpt'}" in refusals[name], refusals[name]
        assert loaded == {"v1": True, "crc32": True}
        assert listing == ["gen_000000", "manifest.json"]
        assert damaged == ["meta.pt", "shard_00000.pt", "shard_00001.pt"]  # as it was, no manifest
    (both, both_out), (bad, bad_out), (again, again_out) = results[0][1]
    assert (
        both == 0 and "converted from sharded-v1" in both_out and "converted from sharded-v2 with a CRC-32" in both_out
    )
    assert bad == 1 and "shard_00001.pt: unreadable" in bad_out and "nothing was converted" in bad_out
    assert again == 0 and "already current" in again_out, again_out
