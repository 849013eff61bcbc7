"""The accuracy study's fast version (benchmarks/accuracy_study.py --smoke), as CI runs it.

Checks, for every preset (baseline, qw, qwd, ulq, tlq, tlq_hs, sdp4bit) trained as a job of
2 virtual nodes x 2 ranks (simulated in one process: the smoke's only difference from the study):
- the run finishes and its validation loss falls, from the first evaluation to the last and
  well below a uniform guess over bytes;
- every run saw the same number of tokens;
- each preset put on the wire the bits its name promises (e.g. qw/qwd 4.016 bits per weight in
  both stages of the all-gather, tlq 8.25 / 4.25 bits per gradient element inside / across
  nodes, baseline 32);
- the report has one row per preset, named as the preset, and the plot exists; docs/ is untouched.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRESETS = ["baseline", "qw", "qwd", "ulq", "tlq", "tlq_hs", "sdp4bit"]
WEIGHT_4BIT, GRAD_8BIT, GRAD_4BIT = 4 + 32 / 2048, 8 + 32 / 128, 4 + 32 / 128
EXPECTED_BITS = {  # fp32 training on CPU: uncompressed weights and gradients travel as 32 bits
    "baseline": {"weight": 32, "grad_reduce_scatter": 32},
    "qw": {"weight": WEIGHT_4BIT, "grad_reduce_scatter": 32},
    "qwd": {"weight": WEIGHT_4BIT, "grad_reduce_scatter": 32},
    "ulq": {"weight": 32, "grad_intra": GRAD_4BIT, "grad_inter": GRAD_4BIT},
    "tlq": {"weight": 32, "grad_intra": GRAD_8BIT, "grad_inter": GRAD_4BIT},
    "tlq_hs": {"weight": 32, "grad_intra": GRAD_8BIT, "grad_inter": GRAD_4BIT},
    "sdp4bit": {"weight": WEIGHT_4BIT, "grad_intra": GRAD_8BIT, "grad_inter": GRAD_4BIT},
}
# With 2 nodes x 2 the weight all-gather's second stage (inside the node) carries the same codes.
for bits in EXPECTED_BITS.values():
    bits["weight_intra"] = bits["weight"]


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> Path:
    results = tmp_path_factory.mktemp("accuracy_smoke")
    docs_before = sorted(p.name for p in (ROOT / "docs").iterdir())
    command = [sys.executable, str(ROOT / "benchmarks" / "accuracy_study.py"), "--smoke", "--results", str(results)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    assert sorted(p.name for p in (ROOT / "docs").iterdir()) == docs_before
    return results


def read_run(results: Path, preset: str) -> tuple[dict, list[float]]:
    run = results / f"{preset}_seed0" / "version_0"
    summary = json.loads((run / "summary.json").read_text())
    rows = (run / "metrics.csv").read_text().splitlines()
    column = rows[0].split(",").index("val/loss")
    return summary, [float(r.split(",")[column]) for r in rows[1:] if r.split(",")[column]]


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_trains_and_its_loss_falls(study, preset):
    summary, val = read_run(study, preset)
    assert len(val) == 3  # evaluations after steps 10, 20, 30
    assert val[-1] < val[0]
    assert val[-1] < math.log(256) - 1.5
    assert summary["train_tokens"] == read_run(study, "baseline")[0]["train_tokens"]
    assert summary["bits_per_element"] == pytest.approx(EXPECTED_BITS[preset])


def test_report_has_one_row_per_preset(study):
    report = (study / "accuracy.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| ") and "compresses" not in line]
    assert [row.split("|")[1].strip() for row in rows[: len(PRESETS)]] == PRESETS
    assert "python benchmarks/accuracy_study.py --smoke" in report
    assert (study / "accuracy.png").stat().st_size > 10_000
