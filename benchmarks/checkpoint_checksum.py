"""What the XXH3-64 checksum of a checkpoint shard adds to its save: a 1 GiB shard written with
and without the checksum, trials interleaved, the best and the median of each.

    .venv/bin/python benchmarks/checkpoint_checksum.py [--gib 1] [--trials 7] [--dir /tmp]

"fsync, with checksum" is what `lightning_sdp4bit.checkpoint.files.checksummed_save` does: torch.save
into a file object that writes 4 MiB pieces, each hashed in a worker thread while it is written,
then fsync. "without checksum" writes the same pieces unhashed, so the difference is the hash
alone. The page-cache variants leave out the fsync, which makes the write as fast as it gets and
so the hash's share the largest. The last row is the write of the previous save (torch.save to a
path, no fsync), for reference. Results are in the CHANGELOG (issue 14).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from cli_args import at_least

from lightning_sdp4bit.checkpoint.files import _PIECE, _ChecksummedFile


class _Pieces:
    """_ChecksummedFile's writes (4 MiB pieces) without the hash: isolates the hash's cost."""

    def __init__(self, file):
        self._file = file

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), _PIECE):
            self._file.write(view[start : start + _PIECE])
        return len(view)

    def flush(self) -> None:
        self._file.flush()


def _pieces(obj: object, path: Path, checksum: bool, sync: bool) -> None:
    with ThreadPoolExecutor(1) as pool, open(path, "wb") as file:
        torch.save(obj, _ChecksummedFile(file, pool) if checksum else _Pieces(file))
        file.flush()
        if sync:
            os.fsync(file.fileno())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=at_least(0.001, float), default=1.0, help="shard size in GiB")
    parser.add_argument("--trials", type=at_least(1), default=7)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to write (a real disk, not tmpfs)")
    args = parser.parse_args(argv)
    numel = int(args.gib * (1 << 30)) // 4
    shard = {"rank": 0, "buckets": [{"master": torch.randn(numel // 2), "weights": torch.randn(numel // 2)}]}
    path = Path(args.dir) / "sdp4bit-checksum-benchmark.pt"
    variants = {
        "page cache, without checksum": lambda obj, p: _pieces(obj, p, checksum=False, sync=False),
        "page cache, with checksum": lambda obj, p: _pieces(obj, p, checksum=True, sync=False),
        "fsync, without checksum": lambda obj, p: _pieces(obj, p, checksum=False, sync=True),
        "fsync, with checksum (the save)": lambda obj, p: _pieces(obj, p, checksum=True, sync=True),
        "previous save: torch.save(path)": lambda obj, p: torch.save(obj, p),
    }
    times: dict[str, list[float]] = {label: [] for label in variants}
    try:
        for _ in range(args.trials):
            for label, save in variants.items():
                path.unlink(missing_ok=True)
                start = time.perf_counter()
                save(shard, path)
                times[label].append(time.perf_counter() - start)
    finally:
        path.unlink(missing_ok=True)
    print(f"| {args.gib:g} GiB shard, {args.trials} trials | best (s) | median (s) |")
    print("|---|---|---|")
    for label, values in times.items():
        print(f"| {label} | {min(values):.3f} | {statistics.median(values):.3f} |")
    best = [min(v) for v in times.values()]
    middle = [statistics.median(v) for v in times.values()]
    for name, i in (("page cache", 0), ("fsync", 2)):
        print(
            f"checksum overhead, {name}: {100 * (best[i + 1] / best[i] - 1):+.1f}% (best), "
            f"{100 * (middle[i + 1] / middle[i] - 1):+.1f}% (median)"
        )
    print(f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
