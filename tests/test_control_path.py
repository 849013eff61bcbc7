"""benchmarks/control_path.py: the engine's control path with the quantization ops replaced by
cached outputs of their shapes. The replaced ops return what the real ones would in shape and
dtype (so the step runs unchanged), and the script prints its table (no timing is checked)."""

import subprocess
import sys
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import control_path  # noqa: E402

from lightning_sdp4bit import ops  # noqa: E402
from lightning_sdp4bit.config import Rounding  # noqa: E402


def test_replaced_ops_give_the_real_shapes_and_the_in_place_argument(monkeypatch):
    for name in control_path.QUANTIZATION_OPS:
        monkeypatch.setattr(ops, name, getattr(ops, name))  # restored after the test
    master, weights = torch.randn(256), torch.randn(256)
    real = ops.weight_update_encode(master, weights, 4, 128, Rounding.NEAREST, 0)
    control_path.replace_quantization_ops()
    for seed in (0, 1):  # the second call: from the cache
        cached = ops.weight_update_encode(master, weights, 4, 128, Rounding.NEAREST, seed)
        assert cached.shape == real.shape and cached.dtype == real.dtype and cached is not real
    payload = torch.zeros(real.shape[1] * 2, dtype=real.dtype).view(2, -1)
    target = torch.zeros(512)
    assert ops.weight_update_apply(payload, target, 4, 128, True) is target


def test_the_script_prints_the_plain_and_engine_rows():
    command = [sys.executable, str(BENCHMARKS / "control_path.py"), "--world", "8", "--layers", "1", "--steps", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {line.split(" | ")[0].strip("| "): line for line in result.stdout.splitlines() if line.startswith("| ")}
    assert {"plain", "engine", "engine - plain, per bucket"} <= set(rows)
    assert "16 buckets" in result.stdout  # 4 + 12 x 1: one bucket per parameter
