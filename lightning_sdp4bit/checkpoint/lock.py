"""One writer per checkpoint path: `x.ckpt.lock`, held by rank 0 for the length of a save.

Two jobs that save to one path interleave their phases (one removes the generation the other
is writing, or commits over it). The lock holds its writer's identity as JSON:

    {"host": "node17", "pid": 4242, "pid_start": 91234567, "job": "SLURM_JOB_ID=81234", "since": "2026-12-01T23:59:01Z"}

**A lock is never seen without its holder.** A writer writes its holder into a draft of its own
(`x.ckpt.lock.<pid>-<pid start>@<host>.draft`, flushed to disk), hard-links it to `x.ckpt.lock`,
which fails if the lock exists, and removes the draft: the open(2) manual's recipe for lock files,
atomic on local file systems and on NFS (where a link whose reply was lost shows in the draft's
link count). A writer killed at any instant leaves no lock or a complete one, and perhaps a draft
(empty, if killed right after creating it), which the next writer removes: its name says whose it
is. On a file system without hard links the lock is created in place (O_CREAT | O_EXCL) and then
written, with a warning: there a writer killed in between leaves an empty lock.

A second writer is refused at once with a `CheckpointError` that names the path and the holder.
A holder that died without releasing it (SIGKILL, a lost node) leaves a **stale** lock, which the
next writer takes over, with a warning that names it, when it can tell:
- the holder ran on this host and its process is gone (or its PID now belongs to a younger process);
- the holder was an earlier incarnation of the same job (the same SLURM job or torchrun run, restarted);
- the lock is empty or unreadable and older than `UNREADABLE_STALE_S`: a writer of an older
  version, or one without hard links, killed between creating it and writing its holder, or a
  damaged file; a younger one may be a writer writing it right now.
A stale lock of another job on another host cannot be told from a live one: the error says to delete the file.
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import time
import warnings
from pathlib import Path
from typing import Any

from lightning_sdp4bit.checkpoint.files import CheckpointError, sibling

__all__ = ["LOCK", "UNREADABLE_STALE_S", "acquire", "held_by_live_writer", "release", "remove_stale_in"]

LOCK = ".lock"
_DRAFT = ".draft"
# A draft's name: the lock's name, then the writer's pid, its start time ("None" without /proc) and host.
_DRAFT_NAME = re.compile(r"(?P<lock>.+\.lock)\.(?P<pid>\d+)-(?P<start>\d+|None)@(?P<host>.+)\.draft")
# An empty or unreadable lock (or draft) is stale at this age, in seconds since its last change:
# longer than a save could take, so that it is never taken from a writer still at work.
UNREADABLE_STALE_S = 600.0
# Environment variables that name the job a process belongs to, the same in every incarnation
# of a restarted job: SLURM keeps the job ID on requeue, torchrun keeps the run ID on restarts.
_JOB_VARIABLES = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "LSB_JOBID", "PBS_JOBID", "JOB_ID")
# What link(2) fails with on a file system without hard links (FAT, some FUSE and SMB mounts).
_NO_HARD_LINKS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})
# A lock found empty is read again this often, this many times (1 s), before the writer gives up.
_ATTEMPTS = 20
_EMPTY_WAIT_S = 0.05


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


def _read(file: Path) -> dict[str, Any] | None:
    """The holder recorded in a lock or draft; {} for an empty or damaged one; None if it is gone."""
    try:
        holder = json.loads(file.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _age(file: Path) -> float | None:
    """Seconds since `file` last changed (0 for a clock ahead of ours); None if it is gone."""
    try:
        return max(0.0, time.time() - file.stat().st_mtime)
    except FileNotFoundError:
        return None


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


def _provably_gone(file: Path, holder: dict[str, Any]) -> str | None:
    """Why the writer of a lock or draft is certainly gone, or None: its process on this host is
    gone, or the file has had no holder for longer than a save could take."""
    if holder:
        return "its process is gone" if _alive(holder) is False else None
    age = _age(file)
    if age is None or age < UNREADABLE_STALE_S:
        return None
    return f"it has been empty or unreadable for {age:.0f} s (stale after {UNREADABLE_STALE_S:.0f} s)"


def _stale(file: Path, holder: dict[str, Any]) -> str | None:
    """Why a writer may take this lock over, or None: its holder is provably gone, or it is an
    earlier run of this very job (whose processes a restart has replaced)."""
    gone = _provably_gone(file, holder)
    if gone is not None:
        return gone
    job = _job()
    if holder and job is not None and holder.get("job") == job and _alive(holder) is None:
        return "it is an earlier run of this job"
    return None


def acquire(path: Path) -> None:
    """Take `path`'s lock for this process, or raise a CheckpointError naming the other writer."""
    lock = sibling(path, LOCK)
    _remove_abandoned_drafts(lock.parent, lock.name)
    draft = _write_draft(lock)
    try:
        holder = _take(lock, draft)
    finally:
        draft.unlink(missing_ok=True)
    if holder is None:
        return
    if not holder:
        raise CheckpointError(
            f"{path}: its lock file {lock} is empty or unreadable and {_age(lock) or 0:.0f} s old: a writer killed "
            "while creating it, or one writing it now. It is taken over once it is "
            f"{UNREADABLE_STALE_S:.0f} s old; if no other job is saving to {path}, delete {lock}."
        )
    raise CheckpointError(
        f"{path} is being saved by another writer ({_describe(holder)}; lock file {lock}). Two jobs must "
        "not save to one checkpoint path: give this one another directory. If that writer is gone (killed "
        f"on another host), delete {lock}."
    )


def _take(lock: Path, draft: Path) -> dict[str, Any] | None:
    """Link `draft` to `lock`, taking a stale lock over; None once this process holds the lock,
    else the holder that keeps it ({} for a lock that stayed empty or unreadable)."""
    holder: dict[str, Any] = {}
    for _ in range(_ATTEMPTS):
        if _link(draft, lock):
            return None
        found = _read(lock)
        if found is None:
            continue  # released meanwhile
        holder = found
        if _is_mine(holder):
            return None  # an earlier save of this process that failed before its release
        why = _stale(lock, holder)
        if why is not None:
            warnings.warn(f"sdp4bit: taking over the stale lock {lock} ({_describe(holder)}): {why}", stacklevel=4)
            _remove_if_unchanged(lock, holder)
        elif holder:
            return holder
        else:
            time.sleep(_EMPTY_WAIT_S)  # a writer without hard links may be writing its holder now
    return holder


def _write_draft(lock: Path) -> Path:
    """This process's holder in a new draft beside `lock`, flushed to disk."""
    me = _me()
    draft = lock.with_name(f"{lock.name}.{me['pid']}-{me['pid_start']}@{me['host']}{_DRAFT}")
    try:
        with open(draft, "w") as file:
            json.dump(me, file)
            file.flush()
            os.fsync(file.fileno())
    except BaseException:
        draft.unlink(missing_ok=True)
        raise
    return draft


def _link(draft: Path, lock: Path) -> bool:
    """Make `lock` a second name of `draft`; False if a lock stands there already."""
    try:
        os.link(draft, lock)
        return True
    except OSError as error:
        if draft.stat().st_nlink == 2:
            return True  # NFS: the link was made and its reply lost (a retry then found it: EEXIST)
        if isinstance(error, FileExistsError):
            return False
        if error.errno in _NO_HARD_LINKS:
            return _create_in_place(lock)
        raise


def _create_in_place(lock: Path) -> bool:
    """Without hard links: create `lock` (O_CREAT | O_EXCL) and write the holder into it; False if
    a lock stands there already. A writer killed in between leaves it empty (see UNREADABLE_STALE_S)."""
    warnings.warn(
        f"sdp4bit: {lock.parent} has no hard links: the lock {lock.name} is created in place, so a writer killed "
        f"while creating it leaves it empty, which is taken over once it is {UNREADABLE_STALE_S:.0f} s old",
        stacklevel=5,
    )
    try:
        descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        with os.fdopen(descriptor, "w") as file:
            json.dump(_me(), file)
            file.flush()
            os.fsync(file.fileno())
    except BaseException:
        lock.unlink(missing_ok=True)  # an empty lock would hold every later writer back
        raise
    return True


def _remove_if_unchanged(lock: Path, holder: dict[str, Any]) -> None:
    """Remove a stale lock, unless another writer replaced it since it was read."""
    if _read(lock) == holder:
        try:
            lock.unlink()
        except FileNotFoundError:
            pass


def _remove_abandoned_drafts(directory: Path, lock_name: str | None = None) -> None:
    """Remove the drafts in `directory` (of the lock `lock_name`, or of any) that no writer will
    link: this process's own (left by an attempt that failed), those of a process on this host
    that is gone, and those older than a save could take."""
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return
    for entry in entries:
        name = _DRAFT_NAME.fullmatch(entry.name)
        if name is None or (lock_name is not None and name["lock"] != lock_name):
            continue
        start = None if name["start"] == "None" else int(name["start"])
        writer = {"host": name["host"], "pid": int(name["pid"]), "pid_start": start}
        age = _age(entry)
        if _is_mine(writer) or _alive(writer) is False or (age is not None and age >= UNREADABLE_STALE_S):
            entry.unlink(missing_ok=True)


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
    """Whether another process may be saving to `path` right now (its lock is not stale)."""
    lock = sibling(path, LOCK)
    holder = _read(lock)
    return holder is not None and not _is_mine(holder) and _stale(lock, holder) is None


def remove_stale_in(directory: Path) -> None:
    """Remove, with a warning that names each, the locks in `directory` whose writer is provably
    gone (see `_provably_gone`), and the drafts no writer will link. For a launcher before any
    rank starts: a restarted job's own earlier locks are left to its first save, which takes them over."""
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return
    for lock in (e for e in entries if e.name.endswith(LOCK) and e.is_file()):
        holder = _read(lock)
        why = None if holder is None or _is_mine(holder) else _provably_gone(lock, holder)
        if why is not None:
            warnings.warn(f"sdp4bit: removing the stale lock {lock} ({_describe(holder or {})}): {why}", stacklevel=3)
            _remove_if_unchanged(lock, holder or {})
    _remove_abandoned_drafts(directory)
