"""The GPU accuracy study's verdicts (benchmarks/accuracy_gpu_report.py): pending until their runs
exist, and a "within x%" verdict says when its line is nearer than the noise; an ordering judged
by a seed spread waits for a second seed."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accuracy_gpu_report import _verdicts  # noqa: E402

BASE = 1.0


def verdict(lines: list[str], start: str) -> str:
    (line,) = [line for line in lines if line.startswith(f"- {start}")]
    return line


def test_verdicts_wait_for_their_runs():
    lines = _verdicts({"baseline": BASE}, {"baseline": 0.0}, noise=None)
    assert all("**pending**" in line for line in lines)
    assert "(needs baseline, qw)" in verdict(lines, "qW worse")


def test_a_verdict_far_from_its_line_is_plain_and_one_near_it_says_so():
    means = {"baseline": BASE, "sdp4bit": BASE * 1.0010, "qwd": BASE * 1.0002}
    spreads = {"baseline": 0.0, "sdp4bit": 0.0005, "qwd": 0.0}
    clear = _verdicts(means, spreads, noise=0.0004)
    assert verdict(clear, "SDP4Bit").endswith("**holds**")  # 0.10% against a 0.25% line, noise 0.05%
    assert verdict(clear, "qWD").endswith("**holds**")  # 0.02% against a 0.10% line, floor 0.04%
    near = _verdicts({**means, "sdp4bit": BASE * 1.0024}, {**spreads, "sdp4bit": 0.0056}, noise=0.0013)
    assert verdict(near, "SDP4Bit").endswith(
        "**holds** (+0.240%; the 0.25% line is nearer than the seed spread, 0.56%: these runs do not decide it)"
    )
    over = _verdicts({**means, "sdp4bit": BASE * 1.0030}, {**spreads, "sdp4bit": 0.0001}, noise=0.0013)
    expected = "**does not hold** (+0.300%; the 0.25% line is nearer than the noise floor, 0.13%"
    assert expected in verdict(over, "SDP4Bit")


def test_orderings_use_the_seed_spread_and_the_floor():
    means = {"baseline": BASE, "qw": BASE + 0.02, "tlq": BASE + 0.011, "tlq_hs": BASE + 0.001, "ulq": BASE + 0.03}
    spreads = {"baseline": 0.0, "qw": 0.0, "tlq": 0.002, "tlq_hs": 0.009, "ulq": 0.0}
    lines = _verdicts(means, spreads, noise=0.001)
    assert verdict(lines, "qW worse").endswith("**holds**")  # 0.02 > 10 x 0.001
    assert verdict(lines, "TLq worse").endswith(
        "**holds** (TLq +0.01000 nats against TLq-HS; seed spread 0.00900; the paper 0.0095)"
    )  # 0.010 > 0.009
    assert verdict(lines, "ULq worse").endswith("**holds**")
    closer = _verdicts({**means, "tlq": BASE + 0.009}, spreads, noise=0.003)
    assert "TLq worse than TLq-HS by more than their seed spread: **does not hold** (TLq +0.00800" in verdict(
        closer, "TLq worse"
    )  # 0.008 < 0.009
    assert verdict(closer, "qW worse").endswith("**does not hold**")  # 0.02 < 10 x 0.003


def test_a_one_sided_line_is_not_near_a_preset_better_than_baseline():
    """SDP4Bit's target is one-sided: 0.2% below baseline is 0.45% inside its 0.25% line, farther
    than a 0.3% seed spread, so the verdict is plain; qWD's is two-sided, so 0.08% below baseline
    is 0.02% inside its 0.1% line."""
    means = {"baseline": BASE, "sdp4bit": BASE * 0.998, "qwd": BASE * 0.9992}
    lines = _verdicts(means, {"baseline": 0.0, "sdp4bit": 0.003, "qwd": 0.0}, noise=0.0004)
    assert verdict(lines, "SDP4Bit").endswith("**holds**")
    assert verdict(lines, "qWD").endswith(
        "**holds** (-0.080%; the 0.10% line is nearer than the noise floor, 0.04%: these runs do not decide it)"
    )


def test_one_run_each_of_tlq_and_tlq_hs_gives_the_gap_but_no_verdict():
    means = {"baseline": BASE, "tlq": BASE - 0.14, "tlq_hs": BASE}
    lines = _verdicts(means, {"baseline": None, "tlq": None, "tlq_hs": None}, noise=None)
    assert verdict(lines, "TLq worse").endswith(
        "**pending** (one run of tlq or tlq_hs: no seed spread; TLq -0.14000 nats against TLq-HS; the paper 0.0095)"
    )
    two = _verdicts(means, {"baseline": None, "tlq": 0.01, "tlq_hs": None}, noise=None)
    assert "**pending** (one run of tlq or tlq_hs" in verdict(two, "TLq worse")
