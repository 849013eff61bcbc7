"""A full disk during a save, on 2 ranks and a real full file system (a tmpfs too small for the
shards; mounting needs root, as CI runs): the save raises one CheckpointError on every rank that
says the disk is full (ENOSPC), names the file and gives the space left, instead of torch.save's
"enforce fail ... unexpected pos"; the checkpoint committed before stays loadable."""

import os
import subprocess
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import make_engine, same, snapshot, train_step
from distributed import run_workers

TMPFS_BYTES = 640 * 1024
"""Room for one checkpoint of the 1-block model (2 shards and meta.pt, 455 KB), not for a second."""


@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(tmp_path)])
    if mounted.returncode != 0:
        pytest.skip(f"mount -t tmpfs failed here (exit {mounted.returncode}): no small file system to fill")
    yield tmp_path
    subprocess.run(["umount", str(tmp_path)], check=True)


def _save_until_full(rank, world, directory):
    from lightning_sdp4bit.checkpoint import CheckpointError, load_sharded, save_sharded

    engine, optimizer = make_engine(rank, world)
    train_step(engine, optimizer, seed=1)
    first = Path(directory) / "a.ckpt"
    save_sharded(engine, [optimizer], {}, first, torch.distributed.barrier)
    saved = snapshot(engine, optimizer)
    train_step(engine, optimizer, seed=2)
    error = None
    try:
        save_sharded(engine, [optimizer], {}, Path(directory) / "b.ckpt", torch.distributed.barrier)
    except CheckpointError as caught:
        error = str(caught)
    load_sharded(engine, [optimizer], first)
    return error, same(snapshot(engine, optimizer), saved)


def test_a_full_disk_inside_torch_save_says_enospc_with_the_file_and_the_free_space(small_disk):
    results = run_workers(_save_until_full, 2, str(small_disk))
    (error, intact), (other_error, other_intact) = results
    assert error is not None and error == other_error
    assert "the disk is full (ENOSPC: No space left on device)" in error, error
    assert "b.ckpt.partial/gen_000000/shard_0000" in error, error
    assert " bytes free of " in error and "unexpected pos" not in error, error
    assert intact and other_intact
