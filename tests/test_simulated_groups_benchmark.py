"""benchmarks/simulated_groups.py: it times every case, and a bad --repeats is refused by name."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "simulated_groups.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def test_every_case_gets_a_row():
    result = _run("--repeats", "1")
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| reduce") or line.startswith("| all")]
    assert [row.split(" | ")[0:2] for row in rows] == [
        ["| reduce_scatter", "4 x 2,000,000"],
        ["| reduce_scatter", "16 x 500,000"],
        ["| all_to_all", "4 x 2,000,000"],
        ["| all_to_all", "16 x 500,000"],
    ]


def test_a_bad_repeats_is_refused_by_name():
    result = _run("--repeats", "0")
    assert result.returncode == 2 and "--repeats must be at least 1, got 0" in result.stderr
