"""The strategy's `timeout=` bounds a stalled rank (issue 26, item 1): a 2-rank job started with
Lightning's popen launcher, one rank asleep in its third step, ends within the timeout plus a few
seconds, with every process gone and an error that says the collective timed out:
- under the Trainer, rank 1 stalls: rank 0 times out in the engine's exchange, and its failure
  also stops the stalled rank (Lightning's launcher would leave it running, orphaned);
- under Fabric, rank 0 (the launcher's own process) stalls: rank 1 times out, and Lightning's
  child-process observer stops rank 0.
Before the fix the engine's process groups kept torch's 30-minute default: nothing failed.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

JOB = Path(__file__).parent / "stall_job.py"
TIMEOUT_S = 5
"""The strategy's collective timeout in these jobs."""
JOB_BOUND_S = 120
"""How long the test waits for the job to end: start-up (~15 s on 2 busy cores), two steps, the
timeout and the launcher's 5 s poll, with room to spare; far below torch's 30-minute default."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize(("kind", "stalled_rank"), [("trainer", 1), ("fabric", 0)])
def test_a_stalled_rank_ends_the_job_within_the_timeout(tmp_path, kind, stalled_rank):
    env = {**os.environ, "STALL_PIDS": str(tmp_path)}
    env.pop("MASTER_PORT", None)
    job = subprocess.Popen(
        [sys.executable, str(JOB), kind, str(stalled_rank), str(TIMEOUT_S)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = job.communicate(timeout=JOB_BOUND_S)
        pids = {path.name: int(path.read_text()) for path in tmp_path.glob("rank*")}
        deadline = time.monotonic() + 30  # the other rank is killed right after the first one fails
        while any(_alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.5)
        survivors = {name: pid for name, pid in pids.items() if _alive(pid)}
    finally:
        try:
            os.killpg(job.pid, signal.SIGKILL)  # whatever the job left: the test's own processes
        except ProcessLookupError:
            pass
        job.wait()
    assert job.returncode != 0, output[-3000:]
    assert "the job finished although a rank stalled" not in output
    assert f"Timed out waiting {TIMEOUT_S * 1000}ms" in output, output[-3000:]
    assert sorted(pids) == ["rank0", "rank1"] and not survivors, (survivors, output[-3000:])
