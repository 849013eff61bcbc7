"""SIGTERM, as SLURM and Kubernetes preempt a job, on 2 CPU ranks:
- in one pair of processes, one fit after another: SIGTERM to rank 0 or rank 1 at file
  operations of a save of `last.ckpt` (before its first write, before a shard's fsync, around
  the manifest's commit, after it) and in backward while bucket exchanges are in flight: both
  ranks stop with Lightning's SIGTERMException at the same step, right after that save
  completes, OnExceptionCheckpoint saves on every rank together, and `fit(ckpt_path="last")`
  resumes from that step and ends bit for bit like a straight run. Lightning's own handler hung
  every rank here (it broadcasts from inside the signal handler);
- as a user runs it, under Lightning's launcher (popen: rank 0 SIGTERMed between writing the new
  manifest and renaming it into place) and under torchrun (rank 1 SIGTERMed before its shard's
  fsync): both processes exit (status 0, as Lightning's
  SIGTERM exit) at the same step instead of hanging, and last.ckpt is complete.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed import run_workers
from lightning_runs import make_trainer, sdp4bit, weights
from models import TinyLMModule
from preemption_helpers import sigterm_in_backward, sigterm_in_save

MAX_STEPS = 5
SIGTERM_STEP = 3  # the signal comes in the save after step 3, or in the backward that makes it
# Rank 0's file operations in a save over a committed checkpoint: mkdir gen, open+save+fsync its
# shard, meta.pt, fsync the folder, manifest.json.tmp, fsync, replace (the commit), fsync, rmtree.
KILL_POINTS = [
    (0, "mkdir"),
    (0, "fsync"),
    (0, "open:manifest.json.tmp"),
    (0, "replace"),
    (0, "rmtree"),
    (1, "open"),
    (1, "fsync"),
    (0, "backward"),
    (1, "backward"),
]


def _module():
    return TinyLMModule(dataset_size=1, repeat=32)


def _checkpointing(directory, *extra):
    from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

    return [
        ModelCheckpoint(dirpath=directory, save_last=True, save_top_k=0, every_n_train_steps=1),
        OnExceptionCheckpoint(dirpath=directory),  # saves on_exception.ckpt, on every rank together
        *extra,
    ]


def _sigterm_then_resume(rank, world, directory):
    from lightning.pytorch.callbacks import Callback

    from lightning_sdp4bit import SDP4BitStrategy
    from lightning_sdp4bit.checkpoint import is_sharded_checkpoint, read_meta

    class StartStep(Callback):
        def on_train_start(self, trainer, module):
            self.step = trainer.global_step

    straight = _module()
    make_trainer(world, sdp4bit(), max_steps=MAX_STEPS).fit(straight)
    expected = weights(straight)
    outcomes = []
    for index, (victim, at) in enumerate(KILL_POINTS):
        folder = f"{directory}/{index}"
        if at == "backward":
            extra, injected = [sigterm_in_backward(victim, SIGTERM_STEP)], None
        else:
            extra, injected = [], sigterm_in_save(SDP4BitStrategy, victim, at, SIGTERM_STEP)
        trainer = make_trainer(
            world, sdp4bit(), max_steps=MAX_STEPS, enable_checkpointing=True, callbacks=_checkpointing(folder, *extra)
        )
        stopped = None
        try:
            if injected is None:
                trainer.fit(_module())
            else:
                with injected:
                    trainer.fit(_module())
        except SystemExit:  # Lightning's SIGTERMException
            stopped = trainer.global_step
        on_exception = f"{folder}/on_exception.ckpt"
        saved_on_exception = is_sharded_checkpoint(on_exception) and read_meta(on_exception)["lightning"]["global_step"]
        start = StartStep()
        resumed = _module()
        make_trainer(
            world, sdp4bit(), max_steps=MAX_STEPS, enable_checkpointing=True, callbacks=_checkpointing(folder, start)
        ).fit(resumed, ckpt_path="last")
        exact = all(torch.equal(weights(resumed)[name], value) for name, value in expected.items())
        outcomes.append((victim, at, stopped, saved_on_exception, start.step, exact))
    return outcomes


def test_sigterm_at_any_point_of_a_save_or_backward_stops_every_rank_and_resumes(tmp_path):
    results = run_workers(_sigterm_then_resume, 2, str(tmp_path))
    for rank, outcomes in enumerate(results):
        for victim, at, stopped, saved_on_exception, start, exact in outcomes:
            point = (rank, victim, at)
            assert stopped == SIGTERM_STEP, point  # every rank, right after the save in progress
            assert saved_on_exception == SIGTERM_STEP, point  # OnExceptionCheckpoint saved collectively
            assert start == SIGTERM_STEP, point  # "last" is that save's checkpoint
            assert exact, point


SCRIPT = Path(__file__).resolve().parents[1] / "support" / "preemption_script.py"


@pytest.mark.parametrize(
    "launcher, victim, at",
    [("popen", 0, "replace:manifest.json.tmp"), ("torchrun", 1, "fsync")],
)
def test_sigterm_to_one_rank_ends_the_job_under_both_launchers(tmp_path, launcher, victim, at):
    from lightning_sdp4bit.checkpoint import is_sharded_checkpoint, read_meta

    options = json.dumps({"strategy": "sdp4bit", "directory": str(tmp_path), "rank": victim, "save": 3, "at": at})
    runner = [] if launcher == "popen" else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    # Without the fix this hangs until the process group's 30-minute timeout: the timeout here
    # only stops a hang from blocking the suite (it says nothing about how fast the exit is).
    process = subprocess.Popen(
        [sys.executable, *runner, str(SCRIPT), options], stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        _, stderr = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the popen launcher's ranks share its session
        raise
    assert process.returncode == 0, stderr[-3000:]
    ranks = [json.loads((tmp_path / f"result_{rank}.json").read_text()) for rank in (0, 1)]
    assert [(r["outcome"], r["step"]) for r in ranks] == [("sigterm", 3), ("sigterm", 3)]
    assert f"[rank: {victim}] Received SIGTERM: 15" in stderr
    last = tmp_path / "last.ckpt"
    assert is_sharded_checkpoint(last) and read_meta(last)["lightning"]["global_step"] == 3
