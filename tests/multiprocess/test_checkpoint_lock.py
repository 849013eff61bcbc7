"""The writer lock `x.ckpt.lock` is never seen without its holder:
- a writer SIGKILLed before or after any file operation of its lock's acquisition (a 1-rank save,
  and the upgrade tool; a fresh path, and a path whose lock a dead writer left) leaves nothing
  that blocks: the next save or upgrade of the path succeeds, warns naming the lock where it took
  one over, and leaves neither lock nor draft behind. Before, a kill right after the lock's
  creation left it empty and every later save failed ("the lock file is empty or unreadable");
- an empty or a garbage lock older than a save could take is taken over by the next writer, and
  removed by the launcher's sweep, each with a warning that names it; a young one is refused
  with an error that names the lock, its age and when it becomes stale, and the sweep keeps it;
- on a file system without hard links the lock is created in place, with a warning, and released.
"""

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import FileOps, make_engine
from distributed import _context, _free_port, _worker, run_workers

KILL_BOUND_S = 120  # a stuck child fails the test instead of blocking the suite


def _sigkill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _in_acquisition(at: int | None, after: bool):
    """Make `lock.acquire` SIGKILL this process before (or after) its file operation `at`."""
    from lightning_sdp4bit.checkpoint import lock

    original = lock.acquire

    def acquire(path):
        with FileOps(fail_at=at, action=_sigkill_self, after=after):
            original(path)

    lock.acquire = acquire


def _save(rank, world, path, at=None, after=False):
    """A 1-rank save of `path` (killed in its lock's acquisition when `at` is given); the
    warnings it gave about stale locks."""
    from lightning_sdp4bit.checkpoint import save_sharded

    engine, optimizer = make_engine(rank, world)
    if at is not None:
        _in_acquisition(at, after)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_sharded(engine, [optimizer], {}, path, torch.distributed.barrier)
    return [str(w.message) for w in caught if "stale lock" in str(w.message)]


def _upgrade(path, at, after):
    from lightning_sdp4bit.checkpoint.upgrade import upgrade_checkpoint

    _in_acquisition(at, after)
    upgrade_checkpoint(path)


def _killed(target, args, queue=None) -> bool:
    """Run `target(*args)` in a fresh process: True if it died of SIGKILL, False if it ended
    normally (for `distributed._worker`, whose `queue` says whether its function raised)."""
    process = _context().Process(target=target, args=args)
    process.start()
    process.join(KILL_BOUND_S)
    if process.is_alive():
        process.kill()
        raise AssertionError(f"{target.__name__}{args} did not end")
    assert process.exitcode in (0, -signal.SIGKILL), process.exitcode
    if process.exitcode == 0 and queue is not None:
        _, ok, value = queue.get(timeout=10)
        assert ok, value
    return process.exitcode == -signal.SIGKILL


def _save_killed(path, at, after) -> bool:
    """A 1-rank save in its own process group, SIGKILLed at operation `at` of its lock's acquisition."""
    queue = _context().Queue()
    return _killed(_worker, (0, 1, _free_port(), _save, (path, at, after), queue), queue)


def _dead_writer(path: Path) -> int:
    """Leave what a writer on this host killed after its link leaves: its lock and its draft."""
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(finished.stdout)
    host = socket.gethostname()
    holder = json.dumps({"host": host, "pid": pid, "pid_start": 1, "job": None, "since": "2026-12-05T00:00:00Z"})
    Path(f"{path}.lock").write_text(holder)
    Path(f"{path}.lock.{pid}-1@{host}.draft").write_text(holder)
    return pid


def _kill_points(kill, follow_up, path: Path, before=None):
    """For every file operation k of the lock's acquisition, before and after it: `before()` sets
    the path up, `kill(k, after)` SIGKILLs a writer there, and `follow_up()` must then take the
    lock and leave nothing beside the checkpoint. Returns what each follow-up warned."""
    outcomes = []
    for after in (False, True):
        for at in range(100):
            if before is not None:
                before()
            if not kill(at, after):
                break  # the acquisition has fewer operations: every one was a kill point
            left = sorted(p.name for p in path.parent.iterdir())
            warned = follow_up()
            lock = f"{path}.lock"
            assert sorted(p.name for p in path.parent.iterdir()) == [path.name], (at, after, left)
            if path.name + ".lock" in left:  # a lock was left: it was taken over, naming it
                assert any(f"taking over the stale lock {lock}" in w for w in warned), (at, after, warned)
            outcomes.append((at, after, left))
    return outcomes


@pytest.mark.parametrize("dead_writer", [False, True], ids=["fresh", "over-a-dead-writers-lock"])
def test_a_save_killed_at_any_operation_of_its_lock_blocks_no_later_save(tmp_path, dead_writer):
    path = tmp_path / "x.ckpt"
    outcomes = _kill_points(
        lambda at, after: _save_killed(path, at, after),
        lambda: run_workers(_save, 1, path)[0],
        path,
        before=(lambda: _dead_writer(path)) if dead_writer else None,
    )
    # Both ways: a draft, then the lock linked to it (each one a kill point before and after).
    assert len(outcomes) >= 8 and any(f"{path.name}.lock" in left for *_, left in outcomes)
    assert any(name.endswith(".draft") for *_, left in outcomes for name in left)


def test_the_upgrade_tool_killed_at_any_operation_of_its_lock_blocks_no_later_run(tmp_path):
    from lightning_sdp4bit.checkpoint.upgrade import upgrade_checkpoint

    path = tmp_path / "x.ckpt"
    run_workers(_save, 1, path)

    def upgrade_again():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            upgrade_checkpoint(path)  # already current: it takes the lock all the same
        return [str(w.message) for w in caught]

    outcomes = _kill_points(lambda at, after: _killed(_upgrade, (path, at, after)), upgrade_again, path)
    assert len(outcomes) >= 8 and any(f"{path.name}.lock" in left for *_, left in outcomes)


def _age(file: Path, seconds: float) -> None:
    stamp = time.time() - seconds
    os.utime(file, (stamp, stamp))


def test_an_old_empty_or_garbage_lock_is_taken_over_and_a_young_one_refused(tmp_path):
    from lightning_sdp4bit.checkpoint import CheckpointError, lock
    from lightning_sdp4bit.checkpoint.recovery import finish_interrupted_saves

    path = tmp_path / "x.ckpt"
    lock_file = Path(f"{path}.lock")
    old = lock.UNREADABLE_STALE_S + 60
    for content in (b"", b"\x00garbage{"):
        lock_file.write_bytes(content)
        with pytest.raises(CheckpointError) as refused:
            lock.acquire(path)
        assert f"its lock file {lock_file} is empty or unreadable and " in str(refused.value)
        assert f"taken over once it is {lock.UNREADABLE_STALE_S:.0f} s old" in str(refused.value)
        assert finish_interrupted_saves(tmp_path) == [] and lock_file.exists()  # the sweep keeps it too
        _age(lock_file, old)
        with pytest.warns(UserWarning, match=f"taking over the stale lock {lock_file} .*empty or unreadable for"):
            lock.acquire(path)
        assert json.loads(lock_file.read_text())["pid"] == os.getpid()
        lock.release(path)
        lock_file.write_bytes(content)
        _age(lock_file, old)
        with pytest.warns(UserWarning, match=f"removing the stale lock {lock_file} "):
            finish_interrupted_saves(tmp_path)
        assert os.listdir(tmp_path) == []


def test_without_hard_links_the_lock_is_created_in_place(tmp_path, monkeypatch):
    from lightning_sdp4bit.checkpoint import lock

    def no_link(source, target):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_link)
    path = tmp_path / "x.ckpt"
    with pytest.warns(UserWarning, match="has no hard links: the lock x.ckpt.lock is created in place"):
        lock.acquire(path)
    assert json.loads(Path(f"{path}.lock").read_text())["pid"] == os.getpid()
    assert os.listdir(tmp_path) == ["x.ckpt.lock"]  # the draft is gone
    lock.release(path)
    assert os.listdir(tmp_path) == []
