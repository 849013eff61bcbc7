"""Crash safety of sharded checkpoints, on 2 ranks:
- a file operation that fails at any step of a save, on either rank, leaves a complete
  checkpoint at the path the user named: the previous one until the commit, the new one from
  then on, never neither; it loads bit-exactly and trains on like the saved state; the save
  raises the same CheckpointError on every rank instead of hanging a peer. Both a fresh name per
  save (top-k) and an overwritten name (save_last);
- the next successful save removes every leftover (other generations, `.partial`, `.old`), and
  so does the strategy's remove_checkpoint;
- SIGKILL of the whole job around a save's commit, under ModelCheckpoint(save_last=True): just
  before overwriting last.ckpt, just after the first save of last.ckpt committed inside
  last.ckpt.partial, and just after the first save of a fresh top-k name:
  `fit(ckpt_path="last")` finds the old or the new checkpoint (never restarts from step 0),
  resumes bit for bit like a straight run, and leaves no staging directory or lock behind.
"""

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import FileOps, make_engine, same, snapshot, train_step
from distributed import _free_port, _worker, run_workers
from lightning_runs import make_trainer, sdp4bit, weights
from models import TinyLMModule


def _save(engine, optimizer, path):
    from lightning_sdp4bit.checkpoint import save_sharded

    save_sharded(engine, [optimizer], {"tag": str(path)}, path, torch.distributed.barrier)


def _load(engine, optimizer, path):
    from lightning_sdp4bit.checkpoint import load_sharded

    load_sharded(engine, [optimizer], path)
    return snapshot(engine, optimizer)


def _listing(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def _fault_at_every_step(rank, world, directory, overwrite):
    import shutil

    from lightning_sdp4bit.checkpoint import CheckpointError, find_checkpoint, is_sharded_checkpoint

    directory = Path(directory)
    old_path, backup = directory / "a.ckpt", directory / "new-backup.ckpt"
    target = old_path if overwrite else directory / "b.ckpt"
    engine, optimizer = make_engine(rank, world)
    train_step(engine, optimizer, seed=1)
    _save(engine, optimizer, old_path)
    old = snapshot(engine, optimizer)
    train_step(engine, optimizer, seed=3)
    old_then_step = snapshot(engine, optimizer)
    _load(engine, optimizer, old_path)
    train_step(engine, optimizer, seed=2)
    _save(engine, optimizer, backup)
    new = snapshot(engine, optimizer)
    train_step(engine, optimizer, seed=3)
    new_then_step = snapshot(engine, optimizer)
    if rank == 0:
        shutil.copytree(old_path, directory / "pristine.ckpt")

    outcomes = []
    for faulty_rank in range(world):
        for step in range(100):
            if rank == 0:  # the disk as it was before the save
                for leftover in (target, Path(f"{target}.partial"), Path(f"{target}.old")):
                    shutil.rmtree(leftover, ignore_errors=True)
                if overwrite:
                    shutil.copytree(directory / "pristine.ckpt", old_path)
            torch.distributed.barrier()
            _load(engine, optimizer, backup)
            error = None
            with FileOps(fail_at=step if rank == faulty_rank else None) as ops:
                try:
                    _save(engine, optimizer, target)
                except CheckpointError as caught:
                    error = str(caught)
            fired = [ops.fired]
            torch.distributed.broadcast_object_list(fired, src=faulty_rank)
            if not fired[0]:
                assert error is None
                break
            op = ops.ops[step] if rank == faulty_rank else None
            # What is found now: the old checkpoint at its path, and at the target the old or the new one.
            assert is_sharded_checkpoint(old_path), (faulty_rank, step, op)
            if overwrite:
                found = _load(engine, optimizer, target)
            else:
                assert same(_load(engine, optimizer, old_path), old), (faulty_rank, step, op)
                fresh = find_checkpoint(target)
                found = _load(engine, optimizer, fresh) if is_sharded_checkpoint(fresh) else None
            which = "new" if found is not None and same(found, new) else "old" if same(found, old) else "none"
            assert which == "new" or (which == "old" and overwrite) or (which == "none" and not overwrite)
            if found is not None:  # it trains on exactly like the state that was saved
                train_step(engine, optimizer, seed=3)
                assert same(snapshot(engine, optimizer), new_then_step if which == "new" else old_then_step)
            # The next successful save leaves no leftover behind.
            _load(engine, optimizer, backup)
            _save(engine, optimizer, target)
            assert same(_load(engine, optimizer, target), new)
            outcomes.append((faulty_rank, step, op, which, error))
            torch.distributed.barrier()
    generation = sorted(p.name for p in target.iterdir() if p.name.startswith("gen_"))
    listing = {
        "siblings": sorted(p.name for p in directory.iterdir()),
        "target": _listing(target),
        "generation": generation,
    }
    return outcomes, listing


@pytest.mark.parametrize("overwrite", [True, False], ids=["overwritten-name", "fresh-name"])
def test_a_fault_at_any_step_of_a_save_leaves_the_old_or_the_new_checkpoint(tmp_path, overwrite):
    results = run_workers(_fault_at_every_step, 2, str(tmp_path), overwrite)
    outcomes, listing = results[0]
    ops_by_rank = {r: [o for o in outcomes if o[0] == r] for r in (0, 1)}
    assert len(ops_by_rank[0]) >= 6 and len(ops_by_rank[1]) >= 2  # rank 0 commits; rank 1 writes its shard
    for faulty_rank, step, op, which, error in outcomes:
        # Before the commit, the save fails on every rank with one error naming the failing rank.
        if which != "new":
            assert error is not None and f"rank {faulty_rank}: saving" in error, (faulty_rank, step, op)
            assert results[1][0][outcomes.index((faulty_rank, step, op, which, error))][4] == error
    # Once committed, the new checkpoint stays: the outcomes on rank 0 go old..., new... in order.
    order = [which for r, *_, which, _ in outcomes if r == 0]
    assert order == sorted(order, key=lambda w: w == "new") and "new" in order
    # After the last successful save: no .partial or .old beside it, one generation inside it.
    expected = ["a.ckpt", "new-backup.ckpt", "pristine.ckpt"] + ([] if overwrite else ["b.ckpt"])
    assert listing["siblings"] == sorted(expected)
    gen = listing["generation"]
    assert len(gen) == 1
    assert listing["target"] == sorted(
        [gen[0], "manifest.json", f"{gen[0]}/meta.pt", f"{gen[0]}/shard_00000.pt", f"{gen[0]}/shard_00001.pt"]
    )


def _remove_with_leftovers(rank, world, directory):
    from lightning_sdp4bit import SDP4BitStrategy

    path = Path(directory) / "x.ckpt"
    engine, optimizer = make_engine(rank, world)
    _save(engine, optimizer, path)
    if rank == 0:
        for leftover in ("x.ckpt.partial/gen_000000", "x.ckpt.old", "x.ckpt/gen_000007"):
            (Path(directory) / leftover).mkdir(parents=True)
        SDP4BitStrategy().remove_checkpoint(path)  # outside a Trainer its global rank is 0
    torch.distributed.barrier()
    return sorted(os.listdir(directory))


def test_remove_checkpoint_removes_the_leftovers_of_interrupted_saves(tmp_path):
    assert run_workers(_remove_with_leftovers, 2, str(tmp_path)) == [[], []]


# ------------------------------------------------------------------------------------------------
# SIGKILL under Lightning, save_last

MAX_STEPS = 5


def _checkpoint_callback(directory, name):
    from lightning.pytorch.callbacks import ModelCheckpoint

    # "top-k": every step also saves a fresh name (step=N.ckpt), before last.ckpt.
    top_k = -1 if name == "top-k" else 0
    return ModelCheckpoint(
        dirpath=directory, filename="{step}", save_last=True, save_top_k=top_k, every_n_train_steps=1
    )


def _fit_saving_last(rank, world, directory, name, at_step, kill):
    """Save last.ckpt (and with name="top-k" a fresh step=N.ckpt) after every step; at step
    `at_step` rank 0 dies in the save of that name: "before-commit" just before the manifest's
    rename, "after-commit" just after it, where a first save still has to rename its staging
    directory x.ckpt.partial to x.ckpt."""
    from lightning_sdp4bit import SDP4BitStrategy

    original_save, original_replace = SDP4BitStrategy.save_checkpoint, os.replace

    def save_checkpoint(self, checkpoint, filepath, storage_options=None):
        is_last = os.path.basename(filepath) == "last.ckpt"
        if rank != 0 or checkpoint["global_step"] != at_step or is_last != (name == "last"):
            return original_save(self, checkpoint, filepath, storage_options)

        def replace(source, target, **kwargs):
            # The commit is the manifest's rename; a first save commits inside x.ckpt.partial,
            # so dying right after it leaves the staging directory's own rename undone.
            commit = os.path.basename(source) == "manifest.json.tmp"
            if commit and kill == "before-commit":
                os.kill(os.getpid(), signal.SIGKILL)
            original_replace(source, target, **kwargs)
            if commit and kill == "after-commit":
                os.kill(os.getpid(), signal.SIGKILL)

        os.replace = replace
        try:
            return original_save(self, checkpoint, filepath, storage_options)
        finally:
            os.replace = original_replace

    SDP4BitStrategy.save_checkpoint = save_checkpoint
    module = TinyLMModule(dataset_size=1, repeat=32)
    callback = _checkpoint_callback(directory, name)
    make_trainer(world, sdp4bit(), max_steps=MAX_STEPS, enable_checkpointing=True, callbacks=[callback]).fit(module)
    raise AssertionError("the fit should have been killed")


def _resume_last(rank, world, directory, name):
    from lightning.pytorch.callbacks import Callback

    class StartStep(Callback):
        def on_train_start(self, trainer, module):
            self.step = trainer.global_step

    start = StartStep()
    resumed = TinyLMModule(dataset_size=1, repeat=32)
    callbacks = [_checkpoint_callback(directory, name), start]
    trainer = make_trainer(world, sdp4bit(), max_steps=MAX_STEPS, enable_checkpointing=True, callbacks=callbacks)
    trainer.fit(resumed, ckpt_path="last")
    straight = TinyLMModule(dataset_size=1, repeat=32)
    make_trainer(world, sdp4bit(), max_steps=MAX_STEPS).fit(straight)
    return {"start": start.step, "resumed": weights(resumed), "straight": weights(straight)}


def _run_until_killed(fn, world, *args, timeout=300):
    """Start the workers; when one dies, SIGKILL the others (as torchrun's agent would)."""
    context = multiprocessing.get_context("spawn")
    queue, port = context.Queue(), _free_port()
    processes = [context.Process(target=_worker, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout
    while all(p.is_alive() for p in processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join()
    return [p.exitcode for p in processes]


# (name, step of the kill, instant) -> the step fit(ckpt_path="last") resumes from.
KILLS = {
    # Overwriting last.ckpt: the old checkpoint until the commit (before, two renames lost it).
    ("last", 3, "before-commit"): 2,
    # The first save of last.ckpt, committed inside last.ckpt.partial but not renamed: before,
    # "last" found nothing and the fit restarted from step 0.
    ("last", 1, "after-commit"): 1,
    # The first save of a fresh top-k name (step=3.ckpt) before last.ckpt's save of that step:
    # "last" is step 2's; the complete step=3.ckpt.partial is moved into place at the restart.
    ("top-k", 3, "after-commit"): 2,
}


@pytest.mark.parametrize(("name", "at_step", "kill"), list(KILLS), ids=["-".join(map(str, k)) for k in KILLS])
def test_sigkill_around_the_commit_then_fit_last_resumes_exactly(tmp_path, name, at_step, kill):
    codes = _run_until_killed(_fit_saving_last, 2, str(tmp_path), name, at_step, kill)
    assert codes[0] == -signal.SIGKILL
    results = run_workers(_resume_last, 2, str(tmp_path), name)
    for result in results:
        assert result["start"] == KILLS[name, at_step, kill]
        for parameter, expected in result["straight"].items():
            assert torch.equal(result["resumed"][parameter], expected), parameter
    # Every save was completed or redone: no staging directory, lock or old copy is left.
    assert not [p.name for p in tmp_path.iterdir() if not p.name.endswith(".ckpt")]
    if name == "top-k":
        assert (tmp_path / "step=3.ckpt").is_dir()
