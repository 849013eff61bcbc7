"""The accuracy probe (benchmarks/accuracy_probe.py) on CPU, with the study's tiny smoke GPT:
- a run names a preset, a warm-up fraction and a peak learning rate; anything else is refused,
  naming the run and what is allowed;
- the runs train from the study's initial weights with their own schedule: a peak rate of 1e-9
  leaves the validation loss where the initial weights put it, 6e-4 lowers it;
- the fraction of the averaged gradient that is exactly 0 is counted on every rank's shards when
  its optimizer steps: none under the baseline, and under TLq (int4 across nodes, no rotation)
  several times TLq-HS's, whose inverse rotation mixes 32 codes into every element;
- finished runs are kept and skipped by a later call, and the report has a row for each.
"""

import json
import re

import pytest


@pytest.fixture
def probe(benchmark_script):
    return benchmark_script("accuracy_probe")


def test_a_run_is_a_preset_a_warmup_and_a_peak_rate(probe):
    assert probe.parse_run("tlq_hs:0.075:3e-4") == ("tlq_hs", 0.075, 3e-4)
    for spec, message in (
        ("tlq:0.02", "expected PRESET:WARMUP:LR"),
        ("tlq:0.02:6e-4:1", "expected PRESET:WARMUP:LR with PRESET one of"),
        ("fast:0.02:6e-4", "expected PRESET:WARMUP:LR with PRESET one of"),
        ("tlq:1.5:6e-4", "the warm-up is a fraction of the steps in [0, 1)"),
        ("tlq:0.02:0", "the warm-up is a fraction of the steps in [0, 1), the peak lr in (0, 1)"),
    ):
        with pytest.raises(ValueError, match=re.escape(f"run {spec!r}: {message}")):
            probe.parse_run(spec)


def test_smoke_runs_count_zeros_and_resume(probe, tmp_path, capsys):
    out, state = tmp_path / "out", tmp_path / "state"
    runs = "baseline:0.1:1e-9,baseline:0.1:6e-4,tlq:0.02:6e-4,tlq_hs:0.02:6e-4"
    probe.main(["--smoke", "--runs", runs, "--steps", "8", "--out", str(out), "--state", str(state)])
    results = {r["run"]: r for r in json.loads((out / "accuracy_probe.json").read_text())}
    assert list(results) == runs.split(",")
    frozen, trained = results["baseline:0.1:1e-9"], results["baseline:0.1:6e-4"]
    assert trained["val"]["8"] < frozen["val"]["8"] - 0.01
    assert abs(frozen["val"]["8"] - frozen["val"]["4"]) < 1e-3
    assert trained["warmup_steps"] == 1 and trained["vocab_size"] > 256
    assert all(f < 1e-3 for f in trained["zero_fraction"].values())
    tlq, tlq_hs = results["tlq:0.02:6e-4"]["zero_fraction"], results["tlq_hs:0.02:6e-4"]["zero_fraction"]
    assert list(tlq) == ["4", "5", "7"] == list(tlq_hs)  # half-way, step 5, the last (step 20 lies beyond)
    assert all(tlq[step] > 3 * tlq_hs[step] for step in tlq)

    capsys.readouterr()
    probe.main(["--smoke", "--runs", runs, "--steps", "8", "--out", str(out), "--state", str(state)])
    assert "pending: []" in capsys.readouterr().out
    probe.main(["--report", str(out / "accuracy_probe.json")])
    table = capsys.readouterr().out
    assert "| `tlq:0.02:6e-4` | tlq | 1 | 0.0006 |" in table and table.count("\n| `") == 4
