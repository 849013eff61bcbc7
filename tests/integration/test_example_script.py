"""examples/train_gpt.py run as a user runs it, in a subprocess.

Checks:
- `--help` prints the usage as written, a continued command line with its backslash, then every
  setting, and starts nothing;
- a bad setting (a missing data file, a value out of range, a node size that does not divide
  the processes) ends the script with one line naming the key and exit status 1, and nothing is
  started: no log directory appears;
- a short run with sdp4bit on 2 CPU processes as 2 virtual nodes, on a file of bytes that are
  not UTF-8: it ends with the summary (the loss fell, fewer bytes on the wire than uncompressed,
  4.016 bits per weight and 4.25 per gradient across nodes), a decoded sample, summary.json and a
  metrics.csv with the validation curve;
- `sdp4bit.simulate=2x2` trains as a job of 4 ranks in one process: the summary counts every
  simulated rank's tokens and bytes;
- `sdp4bit.weight_sharding=node` on 2 processes of one node trains, counts its gathers, sends
  nothing across nodes, and samples after fit (a forward every rank of the node takes part in).
"""

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_gpt.py"


def run_script(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *overrides], capture_output=True, text=True, timeout=300)


def test_help_prints_the_usage_as_written_and_every_setting():
    result = run_script("--help")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "trainer.devices=2 \\\n        trainer.accelerator=cpu" in result.stdout  # copyable as printed
    assert "Settings (" in result.stdout and "n_layer: 4" in result.stdout


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.path=/no/such/file.txt", "error: data.path: '/no/such/file.txt' does not exist"),
        ("model.dropout=2", "error: model.dropout: must be in [0, 1), got 2.0"),
        (
            "sdp4bit.simulate=16by4",
            "error: sdp4bit.simulate: simulate='16by4': expected 'MxL' or (M, L): M nodes of L ranks each, "
            "whole numbers, e.g. '16x4' or (16, 4)",
        ),
        (
            "sdp4bit.simulate=2x2",  # with trainer.devices=2
            "error: trainer.devices: is 2, but a simulated job (sdp4bit.simulate) runs every rank on one device: "
            "set it to 1 or auto",
        ),
        (
            "sdp4bit.ranks_per_node=3",
            "error: sdp4bit.ranks_per_node: ranks_per_node=3 must divide the world size 2: "
            "every node needs the same number of ranks for the two-level all-to-all",
        ),
    ],
)
def test_bad_settings_stop_the_script_before_anything_starts(tmp_path, override, message):
    result = run_script(override, "trainer.accelerator=cpu", "trainer.devices=2", f"trainer.out_dir={tmp_path}")
    assert result.returncode == 1
    assert result.stderr.strip() == message
    assert not any(tmp_path.iterdir())  # no logs: nothing was started


def test_short_run_on_non_utf8_text_ends_with_the_summary(tmp_path):
    rng = random.Random(0)
    words = [b"alpha ", b"beta ", b"\xff\xfe gamma ", b"\x80delta\n", "épsilon ".encode("latin-1")]
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"".join(rng.choice(words) for _ in range(6000)))
    result = run_script(
        f"data.path={corpus}",
        f"trainer.out_dir={tmp_path / 'runs'}",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "sdp4bit.ranks_per_node=1",  # 2 virtual nodes of 1: the int4 inter-node stage
        "model.n_layer=1",
        "model.n_embd=32",
        "model.n_head=2",
        "model.block_size=32",
        "data.batch_size=4",
        "trainer.max_steps=25",
        "trainer.val_every=10",
        "trainer.progress_bar=false",
        "trainer.sample_bytes=40",
        "optim.lr=3e-3",
        "optim.warmup_steps=5",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "=== summary: 25 steps on 2 processes ===" in result.stdout
    assert "sample from the trained model (40 bytes after 'The '):" in result.stdout

    summary = json.loads((tmp_path / "runs" / "version_0" / "summary.json").read_text())
    assert summary["steps"] == 25 and summary["processes"] == 2
    assert summary["train_tokens"] == 25 * 2 * 4 * 32  # steps x processes x batch x context
    assert summary["final_val_loss"] < math.log(256) - 1  # well below a uniform guess over bytes
    assert 0 < summary["wire_bytes"] < summary["uncompressed_bytes"]
    assert summary["bits_per_element"]["weight"] == pytest.approx(4 + 32 / 2048)
    assert summary["bits_per_element"]["grad_inter"] == pytest.approx(4 + 32 / 128)

    metrics = (tmp_path / "runs" / "version_0" / "metrics.csv").read_text().splitlines()
    header = metrics[0].split(",")
    val = [
        float(row.split(",")[header.index("val/loss")])
        for row in metrics[1:]
        if row.split(",")[header.index("val/loss")]
    ]
    assert len(val) == 3  # after steps 10, 20 and the final step 25
    assert val[-1] < val[0]
    assert val[-1] == pytest.approx(summary["final_val_loss"])


# A 1-layer, 32-wide GPT for 4 steps of batch 2, validated once at the end on 2 batches.
FOUR_TINY_STEPS = (
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "model.block_size=32",
    "data.batch_size=2",
    "trainer.max_steps=4",
    "trainer.val_every=4",
    "data.val_batches=2",
    "trainer.progress_bar=false",
)


def test_simulated_job_runs_from_the_example(tmp_path):
    result = run_script(
        f"trainer.out_dir={tmp_path / 'runs'}",
        "trainer.accelerator=cpu",
        "sdp4bit.simulate=2x2",
        *FOUR_TINY_STEPS,
        "trainer.sample_bytes=0",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "=== summary: 4 steps on 4 simulated ranks in 1 process ===" in result.stdout
    summary = json.loads((tmp_path / "runs" / "version_0" / "summary.json").read_text())
    assert summary["train_tokens"] == 4 * 4 * 2 * 32  # steps x simulated ranks x batch x context
    assert summary["bits_per_element"]["grad_inter"] == pytest.approx(4 + 32 / 128)


def test_node_sharded_job_runs_from_the_example_and_samples_on_every_rank(tmp_path):
    result = run_script(
        f"trainer.out_dir={tmp_path / 'runs'}",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "sdp4bit.ranks_per_node=2",
        "sdp4bit.weight_sharding=node",
        *FOUR_TINY_STEPS,
        "trainer.sample_bytes=20",  # a forward after fit: collective inside the node, on every rank
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "sample from the trained model (20 bytes after 'The '):" in result.stdout
    summary = json.loads((tmp_path / "runs" / "version_0" / "summary.json").read_text())
    assert summary["bits_per_element"]["weight_gather"] == 32  # fp32 weights gathered inside the node
    assert "weight" not in summary["bits_per_element"]  # one node: nothing crosses a network
