"""benchmarks/trace_summary.py on hand-made Chrome traces: a stream's busy time is the union of
its intervals, names lose their templates, and the kernels beside a wait are told apart; and on
the gzipped traces that emulated_network.py --profile writes."""

import gzip
import itertools
import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCHMARKS))

import trace_summary  # noqa: E402


def kernel(name, ts, dur, stream):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def write(path: Path, events: list[dict]) -> Path:
    cpu_op = {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000, "args": {}}
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": [cpu_op, *events]}, f)
    return path


def gpu(path: Path) -> list[dict]:
    return trace_summary.gpu_events(trace_summary.trace_events(path))


def test_streams_are_summed_by_union_and_names_lose_their_templates(tmp_path):
    events = [
        kernel("void at::native::(anonymous namespace)::copy_kernel<float, 4>(float*, int)", 0, 100, 7),
        kernel("void at::native::(anonymous namespace)::copy_kernel<float, 4>(float*, int)", 50, 100, 7),
        kernel("nvjet_gemm", 400, 200, 7),
        kernel("_spin_kernel", 0, 1000, 9),
    ]
    summary = trace_summary.summarize(gpu(write(tmp_path / "t.json.gz", events)), steps=2)
    assert summary[7]["busy_ms"] == 0.35 / 2  # [0, 150) and [400, 600) us
    assert summary[7]["sum_ms"] == 0.4 / 2
    assert summary[7]["kernels"]["at::native::copy_kernel"] == (0.1, 1.0)
    assert set(summary) == {7, 9} and summary[9]["busy_ms"] == 0.5


def test_kernels_beside_a_wait_are_compared_apart_from_the_others(tmp_path):
    plain = [kernel("nvjet_a", 0, 100, 7), kernel("nvjet_b", 200, 100, 7), kernel("nvjet_a", 400, 100, 7)]
    # the first runs wholly beside a wait (15% slower), the second 30% beside (left out), the third clear
    waited = [
        kernel("nvjet_a", 0, 115, 3),
        kernel("nvjet_b", 200, 100, 3),
        kernel("nvjet_a", 400, 90, 3),
        kernel("_spin_kernel", 0, 230, 5),
        kernel("other_kernel", 0, 50, 3),
    ]
    traces = [gpu(write(tmp_path / f"{n}.json.gz", e)) for n, e in (("p", plain), ("w", waited))]
    table = trace_summary.beside_table(["p", "w"], traces, steps=1, matrix="nvjet", beside="_spin_kernel")
    assert table[-2] == "| w | 1, 1.150, +0.01 | 1, 0.900, -0.01 |"
    reordered = trace_summary.beside_table(["w", "p"], traces[::-1], 1, "nvjet_a", "_spin_kernel")
    assert reordered[-2].startswith("| p | none | 2, ")
    mismatched = trace_summary.beside_table(["p", "w"], [traces[0], traces[1][1:]], 1, "nvjet", "_spin_kernel")
    assert "differ" in mismatched[-2]


def test_a_dry_run_writes_gzipped_traces_per_run_with_python_calls_that_the_summary_reads(tmp_path):
    command = [
        sys.executable, str(BENCHMARKS / "emulated_network.py"), "--dry-run", "--presets", "sdp4bit",
        "--trainer-presets", "none", "--repeats", "1", "--scenarios", "eth100",
        "--profile", str(tmp_path / "t.json.gz"), "--profile-python",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    traces = sorted(p.name for p in tmp_path.iterdir())
    assert traces == ["t_tiny_plain.json.gz", "t_tiny_sdp4bit_nodes.json.gz"]
    for name in traces:
        with gzip.open(tmp_path / name, "rt") as f:
            assert any(e.get("cat") == "cpu_op" for e in json.load(f)["traceEvents"])
    # --profile-python: the host's Python calls, the engine's among them, on the loop's thread
    calls = trace_summary.python_calls(trace_summary.trace_events(tmp_path / "t_tiny_sdp4bit_nodes.json.gz"))
    assert any(trace_summary.OURS.search(e["name"]) and "wait_weights" in e["name"] for e in calls)
    summary = subprocess.run(
        [sys.executable, str(BENCHMARKS / "trace_summary.py"), *(str(tmp_path / n) for n in traces)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert summary.returncode == 0 and "### t_tiny_sdp4bit_nodes" in summary.stdout, summary.stderr


def test_the_links_idle_gaps_name_what_the_compute_stream_ran(tmp_path):
    events = [
        kernel("_spin_kernel", 0, 1000, 5),  # the NIC's lane: waits longest
        kernel("_spin_kernel", 4000, 1000, 5),
        kernel("_spin_kernel", 5200, 1000, 5),  # a 0.2 ms gap: below --gaps
        kernel("_spin_kernel", 0, 300, 6),  # NVLink's lane
        kernel("nvjet_head", 1500, 1000, 7),
        kernel("nvjet_head", 2600, 600, 7),
        kernel("softmax", 3500, 1000, 7),  # half inside the gap
    ]
    table = trace_summary.gaps_table(
        "t",
        gpu(write(tmp_path / "t.json.gz", events)),
        "nvjet",
        "_spin_kernel",
        1.0,
    )
    assert table[0].startswith(
        "t: the network link (stream 5) idle for 1 ms or more, and the compute stream (stream 7)"
    )
    assert table[4:] == ["| 1.0 | 3.00 | 2.10 | nvjet_head 1.60; softmax 0.50 |", ""]
    quiet = trace_summary.gaps_table(
        "q",
        gpu(write(tmp_path / "q.json.gz", events[4:])),
        "nvjet",
        "_spin_kernel",
        1.0,
    )
    assert quiet[0] == "q: no `_spin_kernel` kernels, no network link to follow"


def test_the_compute_streams_idle_gaps_say_whether_another_stream_filled_them(tmp_path):
    events = [
        kernel("nvjet_a", 0, 1000, 7),
        kernel("nvjet_a", 2000, 1000, 7),  # a 1 ms gap, filled by an exchange's kernel
        kernel("nvjet_a", 3100, 900, 7),  # a 0.1 ms gap: below --idle
        kernel("nvjet_a", 6000, 1000, 7),  # a 2 ms gap nothing fills: the host's
        kernel("_encode_kernel", 1200, 600, 9),
    ]
    table = trace_summary.idle_table("t", gpu(write(tmp_path / "t.json.gz", events)), "nvjet", 0.5)
    assert table[0] == (
        "t: the compute stream (stream 7) idle for 0.5 ms or more (2 gaps, 3.00 ms in all), and the other streams "
        "meanwhile:"
    )
    assert table[4:] == ["| 1.0 | 1.00 | 0.60 | _encode_kernel 0.60 |", "| 4.0 | 2.00 | 0.00 | nothing |", ""]


def test_the_compute_streams_idle_gaps_are_split_into_waits_for_the_host_and_for_other_streams(tmp_path):
    def queued(name, ts, dur, correlation, launch_end):
        op = kernel(name, ts, dur, 7)
        op["args"]["correlation"] = correlation
        launch = {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": launch_end - 5, "dur": 5}
        launch["args"] = {"correlation": correlation}
        return [op, launch]

    events = [
        *queued("nvjet_a", 0, 1000, 1, -10),
        *queued("nvjet_a", 2000, 1000, 2, 1600),  # a 1 ms gap: 0.6 ms before its launch returned
        *queued("nvjet_a", 5000, 1000, 3, 500),  # a 2 ms gap, the work queued before it began
        kernel("_encode_kernel", 3200, 1800, 9),
    ]
    everything = trace_summary.trace_events(write(tmp_path / "t.json.gz", events))
    gaps = trace_summary.gpu_events(everything)
    table = trace_summary.idle_table("t", gaps, "nvjet", 0.5, steps=2, launched=trace_summary.launch_ends(everything))
    assert table[-2].startswith(
        "Of those 1.50 ms a step, 0.30 ms waited for the host to queue the work that ended the gap and 1.20 ms had "
        "it queued, waiting for another stream's event"
    )


def call(name, ts, dur, python_id, parent, tid=1):
    args = {"Python id": python_id, "Python parent id": parent}
    return {"ph": "X", "cat": "python_function", "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def test_the_host_in_the_compute_streams_gaps_is_counted_by_its_own_time_and_by_the_repositorys_frame(tmp_path):
    events = [
        kernel("nvjet_a", 0, 1000, 7),
        kernel("nvjet_a", 3000, 1000, 7),  # a 2 ms gap, 1000-3000 us, that no stream fills
        call("benchmarks/gpt_step.py(80): engine_step", 0, 4000, 1, 0),
        call("lightning_sdp4bit/schedule.py(176): wait_weights", 500, 2000, 2, 1),  # 1500 us in the gap
        call("<built-in method launch>", 1200, 600, 3, 2),  # its callee: 600 us in the gap
        call("torch/nn/modules/module.py(1): _call_impl", 2600, 1000, 4, 1),  # 400 us in the gap
        call("<built-in method sleep>", 1000, 1000, 5, 0, tid=2),  # another thread: not the loop's
    ]
    everything = trace_summary.trace_events(write(tmp_path / "t.json.gz", events))
    calls = trace_summary.python_calls(everything)
    assert len(calls) == 4
    table = trace_summary.idle_table("t", trace_summary.gpu_events(everything), "nvjet", 1.0, calls, steps=2)
    host = table[table.index("The host's Python calls in those gaps: 1.00 ms a step.") :]
    own, frames = _rows(host, "| function (its own time)"), _rows(host, "| this repository's innermost frame")
    # per step (2): wait_weights 1500 - 600 us of its own, the launch 600, _call_impl 400, engine_step 2000 - 1500 - 400
    assert own == {
        "lightning_sdp4bit/schedule.py(176): wait_weights": "0.45",
        "<built-in method launch>": "0.30",
        "torch/nn/modules/module.py(1): _call_impl": "0.20",
        "benchmarks/gpt_step.py(80): engine_step": "0.05",
    }
    assert (
        trace_summary.idle_table("c", [], "nvjet", 1.0)[0]
        == "c: no `nvjet` kernels (a CPU run?), no compute stream to follow"
    )
    assert frames == {
        "lightning_sdp4bit/schedule.py(176): wait_weights": "0.75",
        "benchmarks/gpt_step.py(80): engine_step": "0.25",
    }


def _rows(lines: list[str], header: str) -> dict[str, str]:
    start = next(i for i, line in enumerate(lines) if line.startswith(header)) + 2
    rows = itertools.takewhile(lambda line: line.startswith("| "), lines[start:])
    return dict(line.strip("| ").rsplit(" | ", 1) for line in rows)


def test_covered_counts_only_what_the_sorted_intervals_cover():
    disjoint = [(0.0, 2.0), (5.0, 6.0), (8.0, 12.0)]
    assert trace_summary.covered(1.0, 9.0, disjoint) == 1.0 + 1.0 + 1.0
    assert trace_summary.covered(2.0, 5.0, disjoint) == 0.0
    assert trace_summary.covered(11.0, 20.0, disjoint) == 1.0
    assert trace_summary.covered(-3.0, 30.0, disjoint) == 7.0
