"""Converting a sharded checkpoint of an older format, in place, to the one this version reads.

    python -m lightning_sdp4bit.checkpoint.upgrade PATH [PATH ...]

The formats (`files`):
- sharded-v1 (lightning-sdp4bit before 2026-12-01): `x.ckpt/meta.pt` and `x.ckpt/shard_NNNNN.pt`,
  no manifest, no checksums. Each file is loaded with weights_only=True (`unpickling`: a v1 file
  carries no checksum at all), the shards' ranks checked, then hard-linked (copied
  where the file system has no hard links) into `x.ckpt/gen_000000/`, and described in a new
  manifest, whose rename commits the conversion; the top-level files are then removed;
- sharded-v2 with a CRC-32 manifest (2026-12-01, before XXH3-64): the manifest's and every file's
  size and CRC-32 are verified, then the manifest is rewritten with XXH3-64 checksums.

The tensors are not touched. A conversion interrupted at any instant leaves the old format (or,
after its commit, the new one), and running it again finishes it. It holds the path's writer lock.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import zlib
from pathlib import Path

from lightning_sdp4bit.checkpoint import lock
from lightning_sdp4bit.checkpoint.files import (
    MANIFEST,
    META,
    SHARDED_V1,
    SHARDED_V2_CRC32,
    SHARDED_V2_XXH3,
    CheckpointError,
    FileRecord,
    Manifest,
    file_checksum,
    read_manifest,
    shard_file,
    sync_directory,
    tensor_records,
    write_manifest,
)
from lightning_sdp4bit.checkpoint.unpickling import load_restricted

__all__ = ["on_disk_format", "upgrade_checkpoint"]

_V1_GENERATION = "gen_000000"
# What a refusal tells a user who trusts the checkpoint (the tool has no weights_only switch).
_OPT_OUT = (
    "allow these types with torch.serialization.add_safe_globals and convert it from Python: "
    "lightning_sdp4bit.checkpoint.upgrade.upgrade_checkpoint(path)"
)


def on_disk_format(path: str | os.PathLike) -> str:
    """Which format the directory `path` holds (files.SHARDED_*); CheckpointError for none of them."""
    path = Path(path)
    manifest = path / MANIFEST
    if not manifest.is_file():
        if (path / META).is_file():
            return SHARDED_V1
        read_manifest(path)  # raises the error that says what is there instead
    try:
        body = json.loads(manifest.read_text())
    except ValueError as error:
        raise CheckpointError(f"{manifest}: unreadable ({error})") from None
    if isinstance(body, dict) and "manifest_crc32" in body and "manifest_xxh3_64" not in body:
        return SHARDED_V2_CRC32
    read_manifest(path)  # any other damage is reported as for loading
    return SHARDED_V2_XXH3


def upgrade_checkpoint(path: str | os.PathLike) -> str:
    """Convert `path` in place to the current format; returns the format it found."""
    path = Path(path)
    found = on_disk_format(path)
    lock.acquire(path)
    try:
        if found == SHARDED_V1:
            _from_v1(path)
        elif found == SHARDED_V2_CRC32:
            _from_crc32(path)
        else:
            _remove_v1_leftovers(path)  # a v1 conversion interrupted after its commit
    finally:
        lock.release(path)
    return found


def _from_v1(path: Path) -> None:
    meta = _load(path / META)
    world_size = int(meta["world_size"])
    generation = path / _V1_GENERATION
    shutil.rmtree(generation, ignore_errors=True)  # an earlier conversion that did not commit
    generation.mkdir()
    try:
        files = {META: FileRecord(*_place(path, generation, META))}
        for rank in range(world_size):
            name = shard_file(rank)
            shard = _load(path / name)
            if shard.get("rank") != rank:
                raise CheckpointError(f"{path / name} holds rank {shard.get('rank')}'s shard, not rank {rank}'s")
            files[name] = FileRecord(*_place(path, generation, name), rank, tensor_records(shard))
    except BaseException:
        shutil.rmtree(generation, ignore_errors=True)  # the v1 files themselves were not touched
        raise
    parameters = {
        name: (tuple(shape), str(bucket["dtype"])) for bucket in meta["layout"] for name, shape, _ in bucket["slots"]
    }
    sync_directory(generation)
    write_manifest(path, Manifest(_V1_GENERATION, world_size, files, parameters))
    _remove_v1_leftovers(path)


def _load(file: Path) -> dict:
    if not file.is_file():
        raise CheckpointError(f"{file} missing: the checkpoint is incomplete, nothing was converted")
    try:
        return load_restricted(file, opt_out=_OPT_OUT)  # weights_only=True: see `unpickling`
    except CheckpointError as error:
        raise CheckpointError(f"{error}; nothing was converted") from None


def _place(path: Path, generation: Path, name: str) -> tuple[int, int]:
    """Hard-link (or copy) `path/name` into the generation; (size, XXH3-64) of the file."""
    try:
        os.link(path / name, generation / name)
    except OSError:
        shutil.copyfile(path / name, generation / name)  # a file system without hard links
    file = generation / name
    return file.stat().st_size, file_checksum(file)


def _remove_v1_leftovers(path: Path) -> None:
    for leftover in [path / META, *path.glob("shard_*.pt")]:
        leftover.unlink(missing_ok=True)


def _from_crc32(path: Path) -> None:
    body = json.loads((path / MANIFEST).read_text())
    stored = body.pop("manifest_crc32")
    if stored != zlib.crc32(json.dumps(body, sort_keys=True).encode()):
        raise CheckpointError(f"{path / MANIFEST}: checksum mismatch (the manifest is damaged), nothing was converted")
    generation = body["generation"]
    files = {}
    for name, record in body["files"].items():
        file = path / generation / name
        if not file.is_file():
            raise CheckpointError(f"{file} missing: the checkpoint is incomplete, nothing was converted")
        if (file.stat().st_size, _crc32(file)) != (record["size"], record["crc32"]):
            raise CheckpointError(f"{file}: size or CRC-32 differs from the manifest (damaged), nothing was converted")
        tensors = tuple((key, tuple(shape), dtype) for key, shape, dtype in record["tensors"])
        files[name] = FileRecord(record["size"], file_checksum(file), record["rank"], tensors)
    parameters = {name: (tuple(shape), dtype) for name, (shape, dtype) in body["parameters"].items()}
    write_manifest(path, Manifest(generation, body["world_size"], files, parameters))


def _crc32(file: Path) -> int:
    value = 0
    with open(file, "rb") as stream:
        while piece := stream.read(4 << 20):
            value = zlib.crc32(piece, value)
    return value


def main(paths: list[str]) -> int:
    if not paths:
        print(f"usage: python -m lightning_sdp4bit.checkpoint.upgrade PATH [PATH ...]\n\n{__doc__}", file=sys.stderr)
        return 2
    failed = False
    for path in paths:
        try:
            found = upgrade_checkpoint(path)
        except CheckpointError as error:
            print(f"{path}: not converted: {error}", file=sys.stderr)
            failed = True
            continue
        done = "already current" if found == SHARDED_V2_XXH3 else f"converted from {found}"
        print(f"{path}: {done}; it reads as {SHARDED_V2_XXH3}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
