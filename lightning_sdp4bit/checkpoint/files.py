"""The on-disk format of a sharded checkpoint: file names, the manifest (the commit record),
XXH3-64 checksums, the checks that refuse incomplete, damaged or misplaced files, and the agreement that
turns one rank's failure into the same `CheckpointError` on every rank.

A checkpoint `x.ckpt` is a directory:

    x.ckpt/manifest.json                 the commit record: written last, renamed into place
    x.ckpt/gen_000003/meta.pt            rank 0: layout, config, step, Lightning's small state
    x.ckpt/gen_000003/shard_00000.pt     one per rank: master and weight slices, optimizer state

The manifest names the generation folder, and for every file its size in bytes, its XXH3-64
checksum and (for a shard) the rank that wrote it and the shape and dtype of each tensor in it; it also lists
every trained parameter's shape and dtype. A checkpoint is **complete** when the manifest is
readable and lists meta.pt and one shard per rank, and every listed file exists with its recorded
size (`check_complete`, which reads no file but the manifest). Loading also recomputes each file's
XXH3-64 checksum and compares every tensor with the manifest (`verify_file`, `check_shard`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path
from typing import IO, Any, cast

import torch
import torch.distributed as dist
import xxhash
from torch import Tensor

from lightning_sdp4bit import comm

__all__ = [
    "FORMAT",
    "MANIFEST",
    "META",
    "CheckpointError",
    "FileRecord",
    "Manifest",
    "agree",
    "check_complete",
    "check_shard",
    "describe",
    "is_sharded_checkpoint",
    "sibling",
    "sync_directory",
    "checksummed_save",
    "file_checksum",
    "read_manifest",
    "shard_file",
    "tensor_records",
    "verify_file",
    "write_manifest",
]

FORMAT = "lightning-sdp4bit/sharded-v2"
# The formats a directory may hold, as errors name them. The manifest's "format" and its checksum
# key tell them apart (both sharded-v2 layouts say FORMAT); only the last one loads.
SHARDED_V1 = "sharded-v1 (meta.pt and shards at the top, no manifest: lightning-sdp4bit before 2026-12-01)"
SHARDED_V2_CRC32 = "sharded-v2 with a CRC-32 manifest (lightning-sdp4bit of 2026-12-01, before XXH3-64)"
SHARDED_V2_XXH3 = "sharded-v2 with an XXH3-64 manifest"
UPGRADE_COMMAND = "python -m lightning_sdp4bit.checkpoint.upgrade"
MANIFEST = "manifest.json"
META = "meta.pt"
# Files are hashed in pieces of this many bytes, each in a worker thread while the next one is
# written or read; smaller writes are hashed inline (a thread hand-off costs more than they do).
_PIECE = 4 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is: incomplete, damaged, misplaced or made for
    another model. The message names the file and what is wrong; under a process group every rank
    raises the same one."""


def shard_file(rank: int) -> str:
    return f"shard_{rank:05d}.pt"


# --------------------------------------------------------------------------------------------
# Checksums


class _RunningHash:
    """XXH3-64 of a byte stream fed piece by piece. Each large piece is hashed in the worker thread
    while the caller writes or reads the next one (xxhash releases the GIL on large buffers)."""

    def __init__(self, pool: ThreadPoolExecutor):
        self._pool, self._state = pool, xxhash.xxh3_64()
        self._pending: Future | None = None

    def update(self, piece: memoryview | bytes) -> None:
        self.wait()  # the previous piece, hashed while this one was produced
        if len(piece) < _PIECE:
            self._state.update(piece)
        else:
            self._pending = self._pool.submit(self._state.update, piece)

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def value(self) -> int:
        self.wait()
        return self._state.intdigest()


class _ChecksummedFile:
    """The file object torch.save writes to: forwards every byte to `file` and keeps its size and
    checksum. A piece's hash runs while that piece is written, and `write` returns only when both
    are done, so torch may reuse its buffer afterwards."""

    def __init__(self, file: Any, pool: ThreadPoolExecutor):
        self._file, self._hash, self.size = file, _RunningHash(pool), 0
        self.write_error: OSError | None = None  # the first failed write (torch.save hides it)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), _PIECE):
            piece = view[start : start + _PIECE]
            self._hash.update(piece)
            try:
                self._file.write(piece)
            except OSError as error:
                self.write_error = self.write_error or error
                raise
        self._hash.wait()
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        self._file.flush()

    @property
    def checksum(self) -> int:
        return self._hash.value()


def checksummed_save(obj: Any, path: Path) -> tuple[int, int]:
    """torch.save `obj` to `path`, flushed to disk (fsync); returns (size in bytes, XXH3-64).
    A full disk raises a CheckpointError that says so, naming the file and the free space."""
    with _full_disk_reported(path):
        with ThreadPoolExecutor(1, thread_name_prefix="sdp4bit-hash") as pool, open(path, "wb") as file:
            writer = _ChecksummedFile(file, pool)
            try:
                torch.save(obj, cast(IO[bytes], writer))  # torch.save calls only write and flush
            except RuntimeError:
                # torch.save reports a failed write of its file object as "[enforce fail at
                # inline_container.cc] unexpected pos": the write's own OSError says why.
                if writer.write_error is None:
                    raise
                raise writer.write_error from None
            file.flush()
            os.fsync(file.fileno())
            return writer.size, writer.checksum


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # no space left; the user's or group's quota exceeded


@contextmanager
def _full_disk_reported(path: Path) -> Iterator[None]:
    """An OSError of a full disk (or quota) while writing `path` becomes a CheckpointError that
    says so and gives the space left on the file system (statvfs: what an unprivileged writer may use)."""
    try:
        yield
    except OSError as error:
        if error.errno not in _DISK_FULL:
            raise
        name = errno.errorcode.get(error.errno or 0, str(error.errno))
        try:
            stats = os.statvfs(path.parent)
            free = f"{stats.f_bavail * stats.f_frsize} bytes free of {stats.f_blocks * stats.f_frsize}"
        except OSError as statvfs_error:
            free = f"free space unknown ({statvfs_error})"
        raise CheckpointError(
            f"{path}: the disk is full ({name}: {error.strerror}); {free} on its file system"
        ) from error


def file_checksum(path: Path) -> int:
    with ThreadPoolExecutor(1, thread_name_prefix="sdp4bit-hash") as pool, open(path, "rb") as file:
        running = _RunningHash(pool)
        while piece := file.read(_PIECE):
            running.update(piece)
        return running.value()


# --------------------------------------------------------------------------------------------
# The manifest


@dataclass(frozen=True)
class FileRecord:
    """One file of a generation, as its writer saw it when it was complete."""

    size: int  # bytes
    checksum: int  # XXH3-64 of the whole file
    rank: int | None = None  # the rank whose shard it is (None for meta.pt)
    tensors: tuple[tuple[str, tuple[int, ...], str], ...] = ()  # (key, shape, dtype) of each tensor in it


@dataclass(frozen=True)
class Manifest:
    generation: str  # the folder, inside the checkpoint directory, that holds the files
    world_size: int
    files: dict[str, FileRecord]  # file name -> record: meta.pt and shard_NNNNN.pt for each rank
    parameters: dict[str, tuple[tuple[int, ...], str]]  # trained parameter -> (shape, dtype)


def tensor_records(obj: Any, prefix: str = "") -> tuple[tuple[str, tuple[int, ...], str], ...]:
    """(key path, shape, dtype) of every tensor inside nested dicts, lists and tuples."""
    if isinstance(obj, Tensor):
        return ((prefix, tuple(obj.shape), str(obj.dtype)),)
    items: Iterable[tuple[Any, Any]]
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return ()
    return tuple(record for key, value in items for record in tensor_records(value, f"{prefix}/{key}"))


def _body(manifest: Manifest) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "generation": manifest.generation,
        "world_size": manifest.world_size,
        "files": {
            name: {"size": r.size, "xxh3_64": r.checksum, "rank": r.rank, "tensors": [list(t) for t in r.tensors]}
            for name, r in manifest.files.items()
        },
        "parameters": {name: [list(shape), dtype] for name, (shape, dtype) in manifest.parameters.items()},
    }


def _checksum_of(body: dict[str, Any]) -> int:
    return xxhash.xxh3_64_intdigest(json.dumps(body, sort_keys=True).encode())


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Commit: write the manifest under a temporary name, flush it, and rename it into place. The
    rename is atomic, so `directory/manifest.json` is at every instant the old or the new one."""
    body = _body(manifest)
    temporary = directory / (MANIFEST + ".tmp")
    with _full_disk_reported(temporary), open(temporary, "w") as file:
        json.dump({**body, "manifest_xxh3_64": _checksum_of(body)}, file, indent=1, sort_keys=True)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, directory / MANIFEST)
    sync_directory(directory)


def sync_directory(directory: Path) -> None:
    """fsync a directory, so that a rename inside it survives a power loss (POSIX; a no-op elsewhere)."""
    if os.name != "posix":
        return
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def read_manifest(path: Path) -> Manifest:
    """The manifest of checkpoint directory `path`; CheckpointError if it is missing or damaged."""
    file = path / MANIFEST
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is a file, not a sharded checkpoint directory"
        raise CheckpointError(f"{path} {what}")
    if not file.is_file():
        if (path / META).is_file():
            raise CheckpointError(_older_format(path, SHARDED_V1))
        raise CheckpointError(
            f"{path}: {MANIFEST} missing: not a complete sdp4bit checkpoint (a save that did not finish, "
            "or a folder of something else)"
        )
    try:
        body = json.loads(file.read_text())
    except ValueError as error:
        raise CheckpointError(f"{file}: unreadable ({error})") from None
    if isinstance(body, dict) and "manifest_crc32" in body and "manifest_xxh3_64" not in body:
        raise CheckpointError(_older_format(path, SHARDED_V2_CRC32))
    try:
        stored = body.pop("manifest_xxh3_64")
    except (KeyError, AttributeError) as error:
        raise CheckpointError(f"{file}: unreadable ({error})") from None
    if stored != _checksum_of(body):
        raise CheckpointError(f"{file}: checksum mismatch (the manifest is damaged)")
    if body.get("format") != FORMAT:
        raise CheckpointError(f"{file}: format {body.get('format')!r}, this version reads {FORMAT!r}")
    files = {
        name: FileRecord(r["size"], r["xxh3_64"], r["rank"], tuple((k, tuple(s), d) for k, s, d in r["tensors"]))
        for name, r in body["files"].items()
    }
    parameters = {name: (tuple(shape), dtype) for name, (shape, dtype) in body["parameters"].items()}
    return Manifest(body["generation"], body["world_size"], files, parameters)


def _older_format(path: Path, found: str) -> str:
    return (
        f"{path} holds an older checkpoint format, {found}; this version reads {SHARDED_V2_XXH3}. Convert it "
        f"in place (every file is verified first; an interrupted conversion leaves it as it was): "
        f"{UPGRADE_COMMAND} {path}"
    )


# --------------------------------------------------------------------------------------------
# Checks


def check_complete(path: Path, manifest: Manifest) -> None:
    """Every file a complete checkpoint needs is listed and present with its recorded size."""
    expected = [META] + [shard_file(rank) for rank in range(manifest.world_size)]
    unlisted = [name for name in expected if name not in manifest.files]
    if unlisted:
        raise CheckpointError(f"{path}/{MANIFEST} does not list {unlisted[:4]}: not a complete sdp4bit checkpoint")
    for name in expected:
        file = path / manifest.generation / name
        if not file.is_file():
            raise CheckpointError(f"{file} missing: not a complete sdp4bit checkpoint")
        if file.stat().st_size != manifest.files[name].size:
            _raise_mismatch(file, manifest, name)


def verify_file(path: Path, manifest: Manifest, name: str) -> Path:
    """Recompute `name`'s size and XXH3-64 checksum and compare them with the manifest; returns the
    file's path, or raises a CheckpointError that says what is wrong with it."""
    file, record = path / manifest.generation / name, manifest.files[name]
    if not file.is_file():
        raise CheckpointError(f"{file} missing: not a complete sdp4bit checkpoint")
    if (file.stat().st_size, file_checksum(file)) != (record.size, record.checksum):
        _raise_mismatch(file, manifest, name)
    return file


def _raise_mismatch(file: Path, manifest: Manifest, name: str) -> None:
    """The diagnosis of a file whose size or checksum differs from its record. One that matches
    another rank's record was swapped or copied from that rank."""
    record, size, checksum = manifest.files[name], file.stat().st_size, file_checksum(file)
    for other, theirs in manifest.files.items():
        if other != name and theirs.rank is not None and (size, checksum) == (theirs.size, theirs.checksum):
            raise CheckpointError(f"{file} holds rank {theirs.rank}'s shard (its bytes are those of {other})")
    if size < record.size:
        raise CheckpointError(f"{file} truncated: {size} of {record.size} bytes")
    if size != record.size:
        raise CheckpointError(f"{file} is {size} bytes, the manifest records {record.size}")
    raise CheckpointError(f"{file}: checksum mismatch (the file is damaged)")


def check_shard(file: Path, shard: dict[str, Any], record: FileRecord) -> None:
    """A loaded shard holds the rank and the tensors (key, shape, dtype) its record lists."""
    if shard.get("rank") != record.rank:
        raise CheckpointError(f"{file} holds rank {shard.get('rank')}'s shard, not rank {record.rank}'s")
    found = tensor_records(shard)
    if found != record.tensors:
        held, listed = next((a, b) for a, b in zip_longest(found, record.tensors) if a != b)
        raise CheckpointError(f"{file} holds tensor {held}, the manifest records {listed}")


# --------------------------------------------------------------------------------------------
# Agreement


def agree(error: str | None, payload: Any = None, group: Any = None, timeouts: comm.Timeouts | None = None) -> list:
    """Every rank of `group` passes its own outcome; returns every rank's payload, in rank order,
    or raises on every rank the same CheckpointError naming each failing rank and its error.

    One all_gather_object, so a rank that failed to read or write tells the others before they
    enter any other collective, instead of leaving them with a peer's socket error. With
    `timeouts` (the engine's or the strategy's), a peer that never arrives (stalled on its disk,
    or dead) ends in `comm.CollectiveTimeoutError` naming this agreement.
    """
    if dist.is_available() and dist.is_initialized():
        outcomes: list[Any] = [None] * dist.get_world_size(group)
        with timeouts.named("the checkpoint's agreement all-gather") if timeouts else contextlib.nullcontext():
            dist.all_gather_object(outcomes, (error, payload), group=group)
    else:
        outcomes = [(error, payload)]
    failures = [(rank, message) for rank, (message, _) in enumerate(outcomes) if message is not None]
    if failures:
        if len(outcomes) > 1 and len(failures) == len(outcomes) and len({m for _, m in failures}) == 1:
            raise CheckpointError(f"on every rank: {failures[0][1]}")
        raise CheckpointError("; ".join(f"rank {rank}: {message}" for rank, message in failures))
    return [payload for _, payload in outcomes]


def sibling(path: Path, suffix: str) -> Path:
    """`x.ckpt` -> `x.ckpt.partial` (a first save being written) or `x.ckpt.old` (what it replaces)."""
    return path.with_name(path.name + suffix)


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """True when `path` is a complete sharded checkpoint (see `check_complete`; no shard is read)."""
    try:
        check_complete(Path(path), read_manifest(Path(path)))
    except (CheckpointError, OSError):
        return False
    return True


def describe(error: BaseException) -> str:
    """The message that `agree` spreads for an exception caught on one rank."""
    return str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"
