"""One writer per checkpoint path: `x.ckpt.lock`, held by rank 0 for the length of a save.

Two jobs that save to one path interleave their phases (one removes the generation the other
is writing, or commits over it). The lock file is created with O_CREAT | O_EXCL, which is atomic
on local file systems and on NFSv3+, and holds its writer's identity as JSON:

    {"host": "node17", "pid": 4242, "pid_start": 91234567, "job": "slurm 81234", "since": "2026-12-01T23:59:01Z"}

A second writer is refused at once with a `CheckpointError` that names the path and the holder.
A holder that died without releasing it (SIGKILL, a lost node) leaves a **stale** lock, which the
next writer takes over, with a warning, when it can tell: the holder ran on this host and its
process is gone (or its PID now belongs to a younger process), or the holder was an earlier
incarnation of the same job (the same SLURM job or torchrun run, restarted). A stale lock of
another job on another host cannot be told from a live one: the error says to delete the file.
"""

from __future__ import annotations

import json
import os
import socket
import time
import warnings
from pathlib import Path
from typing import Any

from lightning_sdp4bit.checkpoint.files import CheckpointError, sibling

__all__ = ["LOCK", "acquire", "held_by_live_writer", "release", "remove_if_stale"]

LOCK = ".lock"
# Environment variables that name the job a process belongs to, the same in every incarnation
# of a restarted job: SLURM keeps the job ID on requeue, torchrun keeps the run ID on restarts.
_JOB_VARIABLES = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "LSB_JOBID", "PBS_JOBID", "JOB_ID")


def _process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux /proc), to tell a reused PID."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the name in (...) may hold spaces


def _job() -> str | None:
    for variable in _JOB_VARIABLES:
        if os.environ.get(variable):
            return f"{variable}={os.environ[variable]}"
    return None


def _me() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_start": _process_start(os.getpid()),
        "job": _job(),
        "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "unknown: the lock file is empty or unreadable"
    job = f", job {holder['job']}" if holder.get("job") else ""
    return f"host {holder.get('host')}, pid {holder.get('pid')}{job}, since {holder.get('since')}"


def _read(lock: Path) -> dict[str, Any] | None:
    """The holder recorded in `lock`; {} for a file being written or damaged; None if it is gone."""
    try:
        holder = json.loads(lock.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _alive(holder: dict[str, Any]) -> bool | None:
    """True or False for a holder on this host; None where this process cannot tell (another host)."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return None
    start = _process_start(holder["pid"])
    if start is None:
        try:
            os.kill(holder["pid"], 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return holder.get("pid_start") is None  # no /proc: trust the PID alone
    return holder.get("pid_start") in (None, start)


def _is_mine(holder: dict[str, Any]) -> bool:
    me = _me()
    return all(holder.get(key) == me[key] for key in ("host", "pid", "pid_start"))


def acquire(path: Path) -> None:
    """Take `path`'s lock for this process, or raise a CheckpointError naming the other writer."""
    lock, holder = sibling(path, LOCK), None
    for _ in range(_ATTEMPTS):
        try:
            descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read(lock)
            if holder is None:
                continue  # released meanwhile
            if not holder:
                time.sleep(_EMPTY_WAIT_S)  # created, its holder not written yet
                continue
            if _is_mine(holder):
                return  # an earlier save of this process that failed before its release
            job, alive = _job(), _alive(holder)
            if alive is False or (job is not None and holder.get("job") == job and alive is None):
                why = "its process is gone" if alive is False else "it is an earlier run of this job"
                warnings.warn(f"sdp4bit: taking over the stale lock {lock} ({_describe(holder)}): {why}", stacklevel=3)
                _remove_if_unchanged(lock, holder)
                continue
            break
        _write_holder(lock, descriptor)
        return
    raise CheckpointError(
        f"{path} is being saved by another writer ({_describe(holder or {})}; lock file {lock}). Two jobs must "
        "not save to one checkpoint path: give this one another directory. If that writer is gone (killed "
        f"on another host), delete {lock}."
    )


# A lock file found empty is re-read this often, this many times, before it counts as damaged.
_ATTEMPTS = 20
_EMPTY_WAIT_S = 0.05


def _write_holder(lock: Path, descriptor: int) -> None:
    try:
        with os.fdopen(descriptor, "w") as file:
            json.dump(_me(), file)
            file.flush()
            os.fsync(file.fileno())
    except BaseException:
        lock.unlink(missing_ok=True)  # an empty lock would refuse every later writer
        raise


def _remove_if_unchanged(lock: Path, holder: dict[str, Any]) -> None:
    """Remove a stale lock, unless another writer replaced it since it was read."""
    if _read(lock) == holder:
        try:
            lock.unlink()
        except FileNotFoundError:
            pass


def release(path: Path) -> None:
    """Give up `path`'s lock if this process holds it."""
    lock = sibling(path, LOCK)
    holder = _read(lock)
    if holder is not None and _is_mine(holder):
        try:
            lock.unlink()
        except OSError as error:
            # The save itself is over; this process takes the lock up again at its next save,
            # and another one finds it stale once this process has exited.
            warnings.warn(f"sdp4bit: could not remove the lock {lock}: {error}", stacklevel=3)


def held_by_live_writer(path: Path) -> bool:
    """Whether another process may be saving to `path` right now (its lock is not provably stale)."""
    holder = _read(sibling(path, LOCK))
    return holder is not None and not _is_mine(holder) and _alive(holder) is not False


def remove_if_stale(path: Path) -> bool:
    """Remove `path`'s lock if its holder ran on this host and is gone; True if it did."""
    lock = sibling(path, LOCK)
    holder = _read(lock)
    if not holder or _is_mine(holder) or _alive(holder) is not False:
        return False
    _remove_if_unchanged(lock, holder)
    return True
