"""The benchmarks a user runs, beyond those with tests of their own (emulated_network,
link_bytes, strategies, the accuracy studies, cluster.py's harness in
tests/support/namespace_cluster.py):
- kernels.py, nccl_check.py and cluster.py start and print their usage (`--help`) on any machine;
- on a CUDA machine, kernels.py times one op at 1 MiB and checks its bytes against the CPU
  reference ("exact" column: yes);
- on a machine with at least two GPUs, nccl_check.py's correctness checks pass."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1]


def _run(script, *args, timeout=300):
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("script", ["kernels.py", "nccl_check.py", "cluster.py"])
def test_the_instrument_prints_its_usage(script):
    result = _run(script, "--help")
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout


@pytest.mark.gpu
def test_kernels_times_one_op_and_checks_its_bytes(tmp_path):
    out = tmp_path / "kernels.md"
    result = _run("kernels.py", "--ops", "weight_update_encode", "--sizes", "1", "--no-compile", "--markdown", str(out))
    assert result.returncode == 0, result.stderr
    row = next(line for line in out.read_text().splitlines() if line.startswith("| 1.0 "))
    assert "| yes |" in row


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nccl_check.py needs two GPUs")
def test_nccl_check_passes_on_two_gpus():
    result = _run("nccl_check.py", "--gpus", "2", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
