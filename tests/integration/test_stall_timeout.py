"""The strategy's `timeout=` bounds a stalled rank: a 2-rank job, one rank asleep in its third
step, ends within the timeout plus a few seconds, with every process gone and the package's own
error (`comm.CollectiveTimeoutError`, after the stall began) naming the rank that
gave up, the collective and the timeout, gloo's error chained. gloo's own words depend on where the
timeout struck ("Timed out waiting 10000ms ..." or, for the other operations in flight on the
group, "Application timeout caused pair closure"), so the test reads the package's:
- Lightning's popen launcher, Trainer, rank 1 stalls: rank 0 times out in the strategy's all-reduce
  for the module's `self.log(..., sync_dist=True)` (before its backward reaches the engine's
  exchanges), and its failure also stops the stalled rank (Lightning's launcher would leave it
  running, orphaned);
- popen, Fabric, rank 1 stalls: rank 0 times out in a gradient exchange, and the uncaught exception
  stops the rank its launcher started (Lightning's child-process observer covers the other way
  round: a started rank that fails takes the launcher's process down);
- torchrun, Trainer, rank 1 stalls: rank 0 times out and torchrun's agent stops rank 1.
The engine's own process groups must take the strategy's timeout: under torch's 30-minute
default nothing here would fail.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from distributed import _free_port

JOB = Path(__file__).resolve().parents[1] / "support" / "stall_job.py"
TIMEOUT_S = 10
"""The strategy's collective timeout in these jobs (also the rendezvous's: room for a rank that
starts late on 2 busy cores)."""
JOB_BOUND_S = 120
"""How long the test waits for the job to end: start-up (~15 s on 2 busy cores), two steps, the
timeout and the launcher's 5 s poll, with room to spare; far below torch's 30-minute default."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize(
    ("launcher", "kind", "stalled_rank"), [("popen", "trainer", 1), ("popen", "fabric", 1), ("torchrun", "trainer", 1)]
)
def test_a_stalled_rank_ends_the_job_within_the_timeout(tmp_path, launcher, kind, stalled_rank):
    env = {**os.environ, "STALL_PIDS": str(tmp_path)}
    env.pop("MASTER_PORT", None)
    start = [sys.executable]
    if launcher == "torchrun":
        start += ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port())]
    job = subprocess.Popen(
        [*start, str(JOB), kind, str(stalled_rank), str(TIMEOUT_S)],
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
    named = rf"CollectiveTimeoutError: sdp4bit: rank {1 - stalled_rank} timed out in .+ \(timeout={TIMEOUT_S} s\)"
    assert re.search(named, output), output[-3000:]
    assert "The above exception was the direct cause of the following exception" in output, output[-3000:]
    assert (tmp_path / "stalled").exists(), output[-3000:]  # it timed out on the stall, not before
    assert sorted(pids) == ["rank0", "rank1"] and not survivors, (survivors, output[-3000:])
