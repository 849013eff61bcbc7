"""examples/fabric_litgpt.py run as a user runs it, in a subprocess: a few steps of a small litgpt
GPT with Fabric(strategy=SDP4BitFabricStrategy) on 2 CPU processes as 2 virtual nodes end with the
summary (the loss fell, fewer bytes than uncompressed) and a sharded checkpoint, with no
missing-zero_grad warning (the loop calls optimizer.zero_grad()); without litgpt
the script stops with one line that says how to install it. Skipped, with the reason, when litgpt
cannot be imported (it is the optional extra `[litgpt]`, part of `[dev]`)."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_sdp4bit.checkpoint import is_sharded_checkpoint

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "fabric_litgpt.py"
SMALL = ["--steps", "6", "--n-layer", "2", "--n-embd", "64", "--block-size", "64", "--batch-size", "4"]


def test_without_litgpt_the_script_says_how_to_install_it():
    # A None entry in sys.modules makes `import litgpt` raise ImportError, as if it were not installed.
    code = f"import runpy, sys; sys.modules['litgpt'] = None; sys.argv = [{str(SCRIPT)!r}]; runpy.run_path(sys.argv[0])"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=SCRIPT.parent, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 1
    assert result.stderr.strip().endswith('pip install ".[litgpt]" in the repository (or pip install litgpt)')


@pytest.mark.skipif(importlib.util.find_spec("litgpt") is None, reason="litgpt is not installed: pip install litgpt")
def test_a_few_steps_train_and_save(tmp_path):
    checkpoint = tmp_path / "fabric.ckpt"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--accelerator", "cpu", *SMALL, "--save", str(checkpoint)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "no zero_grad() in between" not in result.stderr  # the loop calls it
    losses = re.search(r"train loss ([\d.]+) -> ([\d.]+)", result.stdout)
    assert losses is not None, result.stdout
    assert float(losses.group(2)) < float(losses.group(1))
    sent, uncompressed = map(float, re.search(r"rank 0: ([\d.]+) MB, uncompressed ([\d.]+) MB", result.stdout).groups())
    assert 0 < sent < uncompressed / 3
    assert is_sharded_checkpoint(checkpoint)
    assert sorted(p.name for p in checkpoint.glob("gen_*/*")) == ["meta.pt", "shard_00000.pt", "shard_00001.pt"]
