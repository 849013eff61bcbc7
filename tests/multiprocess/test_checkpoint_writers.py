"""One writer per checkpoint path, and readers that never see a committed checkpoint unreadable:
- a save to a path whose lock is held by a live process of this host, or by a process on another
  host, is refused at once on every rank with a CheckpointError naming the path and the holder
  (host, pid); nothing is written;
- a lock left by a process that died on this host is taken over with a warning, and the save
  releases it;
- shards loaded for a meta.pt read before another save committed are refused (the Trainer reads
  the loop state first, the shards later);
- two jobs of 2 ranks save to one path at the same time while a third process reads it in a loop:
  every save either commits or is refused naming the other writer, no read of the committed
  checkpoint fails, and the checkpoint left is one of the two jobs' states.
"""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import torch
from checkpoint_helpers import make_engine, train_step
from distributed import run_workers

SAVES_PER_JOB = 20


def _lock(path: Path, **holder) -> None:
    Path(f"{path}.lock").write_text(json.dumps({"since": "2026-12-01T00:00:00Z", **holder}))


def _save_against_locks(rank, world, directory, live_pid, dead_pid):
    from lightning_sdp4bit.checkpoint import (
        CheckpointError,
        is_sharded_checkpoint,
        load_sharded,
        read_meta,
        save_sharded,
    )

    path = Path(directory) / "x.ckpt"
    engine, optimizer = make_engine(rank, world)
    train_step(engine, optimizer, seed=1)
    host = socket.gethostname()
    refusals = []
    for holder in ({"host": host, "pid": live_pid}, {"host": "elsewhere", "pid": 1, "job": "SLURM_JOB_ID=7"}):
        if rank == 0:
            _lock(path, **holder)
        torch.distributed.barrier()
        try:
            save_sharded(engine, [optimizer], {}, path, torch.distributed.barrier)
        except CheckpointError as error:
            refusals.append(str(error))
        refusals.append(os.path.exists(path) or os.path.exists(f"{path}.partial"))
    if rank == 0:
        _lock(path, host=host, pid=dead_pid)
    torch.distributed.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_sharded(engine, [optimizer], {}, path, torch.distributed.barrier)
    took_over = [str(w.message) for w in caught if "stale lock" in str(w.message)]
    # The Trainer reads meta.pt (the loop state) before the shards: a save in between is refused.
    generation = read_meta(path)["generation"]
    save_sharded(engine, [optimizer], {}, path, torch.distributed.barrier)
    try:
        load_sharded(engine, [optimizer], path, generation)
        changed = None
    except CheckpointError as error:
        changed = str(error)
    return refusals, took_over, is_sharded_checkpoint(path), os.path.exists(f"{path}.lock"), changed


def test_a_second_writer_is_refused_and_a_dead_writers_lock_is_taken_over(tmp_path):
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(finished.stdout)
    results = run_workers(_save_against_locks, 2, str(tmp_path), os.getpid(), dead_pid)
    path = tmp_path / "x.ckpt"
    for rank, (refusals, took_over, committed, locked, changed) in enumerate(results):
        assert changed and "changed while it was loaded: meta.pt was read from gen_000000" in changed, changed
        live, live_wrote, remote, remote_wrote = refusals
        assert live == results[0][0][0] and remote == results[0][0][2]  # the same error on every rank
        assert f"{path} is being saved by another writer (host {socket.gethostname()}, pid {os.getpid()}" in live
        assert "host elsewhere, pid 1, job SLURM_JOB_ID=7" in remote and f"delete {path}.lock" in remote
        assert not live_wrote and not remote_wrote
        assert committed and not locked
        assert (len(took_over) == 1 and f"pid {dead_pid}" in took_over[0]) if rank == 0 else not took_over


def _job(rank, world, directory, seed):
    from lightning_sdp4bit.checkpoint import CheckpointError, save_sharded

    engine, optimizer = make_engine(rank, world)
    train_step(engine, optimizer, seed=seed)
    # Both jobs start saving at once (process start-up alone takes longer than all their saves).
    (Path(directory) / f"ready-{seed}-{rank}").touch()
    while not (Path(directory) / "go").exists():
        time.sleep(0.01)
    outcomes = []
    for _ in range(SAVES_PER_JOB):
        try:
            save_sharded(engine, [optimizer], {"seed": seed}, Path(directory) / "x.ckpt", torch.distributed.barrier)
            outcomes.append("saved")
        except CheckpointError as error:
            outcomes.append(str(error))
    return outcomes, [b.master.clone() for b in engine.buckets]


def test_two_jobs_saving_to_one_path_while_a_reader_reads_it(tmp_path):
    from lightning_sdp4bit.checkpoint import CheckpointError, read_full_state

    path = tmp_path / "x.ckpt"
    results = {}
    jobs = [
        threading.Thread(target=lambda s=s: results.update({s: run_workers(_job, 2, str(tmp_path), s)})) for s in (1, 2)
    ]
    for job in jobs:
        job.start()
    while len(list(tmp_path.glob("ready-*"))) < 4:
        time.sleep(0.05)
    (tmp_path / "go").touch()
    reads, failures = 0, []
    while any(job.is_alive() for job in jobs):
        if not (path / "manifest.json").exists():
            time.sleep(0.01)  # nothing committed yet
            continue
        try:
            read_full_state(path)
            reads += 1
        except CheckpointError as error:
            failures.append(str(error))
    for job in jobs:
        job.join()
    assert not failures and reads > 0, failures[:3]
    for ranks in results.values():
        for outcomes, _ in ranks:
            refused = [o for o in outcomes if o != "saved"]
            assert all(f"{path} is being saved by another writer (host" in o for o in refused), refused[:2]
        assert ranks[0][0] == ranks[1][0]  # the ranks of a job agree on every outcome
    # What is left is a complete checkpoint of one job, which did save.
    assert "saved" in results[read_full_state(path)["meta"]["lightning"]["seed"]][0][0]
