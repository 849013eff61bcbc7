"""benchmarks/engine_ab.py: each tree is installed on its own and each run imports that install.

On the CPU (the emulated network's --dry-run, one tiny row), the checkout itself serves as the
one tree: the run's JSON and tables land in --out and the summary gives the engine row once per
scenario. The summary's medians are checked on made-up runs."""

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_run_of_the_checkout_as_a_tree_writes_its_tables_json_and_summary(benchmark_script, tmp_path, capsys):
    engine_ab = benchmark_script("engine_ab")
    out = tmp_path / "ab"
    engine_ab.main(["--out", str(out), "--rounds", "1", str(REPO), "--", "--dry-run", "--presets", "sdp4bit"])
    printed = capsys.readouterr().out
    name = REPO.name
    document = json.loads((out / f"{name}_1.json").read_text())
    assert {run["row"] for run in document["runs"]} >= {"plain", "sdp4bit", "Trainer + sdp4bit"}
    assert "sdp4bit" in (out / f"{name}_1.md").read_text()
    assert f"| {name} | sdp4bit, nodes | eth100 | 1 |" in printed
    assert f"| {name} | Trainer + sdp4bit, nodes | eth100 | 1 |" in printed


def test_the_summary_gives_each_rows_median_and_range_over_its_runs(benchmark_script):
    engine_ab = benchmark_script("engine_ab")

    def run(step: float, compute: float, lead: float | None, compute_lead: float, hooks: float | None = None) -> dict:
        network = {"step_ms": step, "host_lead_ms": {"backward": lead} if lead is not None else {}}
        compute_only = {"step_ms": compute, "host_lead_ms": {"backward": compute_lead}}
        if hooks is not None:  # the engine watched: ms within its calls
            compute_only["brackets_ms"] = {"weights": 3.5, "gradient hooks": hooks, "gradient finish": 1.0}
        return {"row": "sdp4bit", "topology": "nodes", "compute": compute_only, "eth100": network}

    plain = {"row": "plain", "topology": "", "step_ms": 140.0}
    runs = ((150, 141, 40, 30, 4.7), (190, 168, 0, 2, 4.4), (156, 147, 30, 9.9, 4.9))
    documents = [{"runs": [plain, run(*figures)]} for figures in runs]
    table = engine_ab.summary({"after": documents, "before": [{"runs": [run(160, 150, None, 20)]}]})
    after = (
        "| after | sdp4bit, nodes | eth100 | 3 | 156.0 (150.0-190.0) | 147.0 (141.0-168.0) | 1.050 (1.007-1.200) "
        "| 30.0 (0.0-40.0) | 1 of 3 / 2 of 3 "
        "| 3.50 (3.50-3.50) / 4.70 (4.40-4.90) / 1.00 (1.00-1.00) / 0.00 (0.00-0.00) |"  # no stream waits: 0
    )
    assert after in table
    before = (
        "| before | sdp4bit, nodes | eth100 | 1 | 160.0 (160.0-160.0) | 150.0 (150.0-150.0) | - | - | - / 0 of 1 | - |"
    )
    assert before in table  # its document has no plain run, no network lead and no watch of the engine
    assert "| plain" not in table
