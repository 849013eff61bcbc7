"""The Hadamard diagnostic (benchmarks/hadamard_errors.py, hadamard_diagnostic.py, hadamard_report.py):
- the int4 stage's quantizer: with a heavy outlier in every group the rotation lowers its error
  several-fold; on Gaussian values, which the rotation leaves Gaussian, it changes it by little;
- errors are measured against the exact mean: constant gradients, which both two-level paths carry
  without loss, measure 0 (and the ranks' gradients are left as they were), random ones measure
  exactly ||two-level - sum of the ranks' gradients|| / ||sum||, and the batch's sampling noise is
  the standard error of that mean over the ranks;
- as Adam sees them (each element weighted by Adam's preconditioner): with weights of 1 the errors
  are the plain ones; a spike among values 10^5 times smaller in every block, weighted as Adam
  weights them, shows what the plain norms hide: the rotation spreads the spike's noise onto the
  tiny values, and TLq-HS errs several times more than TLq;
- a group's sums add up its runs of elements, wherever they lie in the bucket;
- a group's shape: a lone spike has max/RMS sqrt(128) and kurtosis 128, a constant group 1 and 1,
  an all-zero group is left out; every GPT parameter has a group;
- the kernel timing calls the real kernels with the presets' settings, rotation off and on: the
  stage-1 payload is int8 by destination, the decoded shard is the reference twin's, bit for bit
  (in Triton's interpreter here);
- the smoke run (a tiny GPT, both vocabularies, on CPU) measures every step it is given (as Adam
  sees it too, from the optimizer's state), writes its output and the tokenizer whose SHA-256 it
  records, and a call with more steps goes on from the saved training state to the same numbers as
  a straight run; a call with nothing pending only writes the output again;
- the report writes the tables of every capture, says the kernel times are pending without a GPU,
  draws the figure, and keeps the notes below its marker when it rewrites the page; with kernel
  times it tabulates them and the rotation's cost a step; it merges two calls' outputs, but not
  outputs of two tokenizers.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "hadamard_diagnostic.py"


@pytest.fixture
def errors(benchmark_script):
    return benchmark_script("hadamard_errors")


def _relative(x: torch.Tensor, reference: torch.Tensor) -> float:
    return ((x - reference).norm() / reference.norm()).item()


def test_the_rotation_lowers_the_int4_error_of_groups_with_an_outlier(errors):
    gauss = torch.randn(64 * 128, generator=torch.Generator().manual_seed(0))
    spiky = gauss.clone()
    spiky[::128] = 40.0  # one outlier in every quantization group
    plain, rotated = (_relative(errors.int4_round_trip(spiky, size, seed=1), spiky) for size in (0, 32))
    assert rotated < plain / 3
    plain, rotated = (_relative(errors.int4_round_trip(gauss, size, seed=1), gauss) for size in (0, 32))
    assert 0.8 < rotated / plain < 1.25


def _measure(errors, grads: torch.Tensor, local: int, adam: torch.Tensor | None = None):
    tally = errors.Tally(["a", "b"])
    labels = torch.zeros(grads.shape[1], dtype=torch.int64)
    labels[grads.shape[1] // 2 :] = 1
    errors.measure_bucket(grads, labels, local, step=3, bucket=0, tally=tally, adam=adam)
    return tally.summary()


def test_errors_as_adam_sees_them(errors):
    world, local, numel = 8, 2, 8 * 256
    grads = torch.randn(world, numel, generator=torch.Generator().manual_seed(1)) / world
    plain = _measure(errors, grads, local)
    unweighted = _measure(errors, grads, local, adam=torch.ones(numel))
    for group in ("a", "b", "all"):
        assert "adam" not in plain[group]
        for key in ("int4_error", "two_level_error", "batch_noise"):
            assert unweighted[group]["adam"][key] == pytest.approx(plain[group][key], rel=1e-12)

    # Every block of 32: one element 10^5 times the others (the same spike on every rank, a little
    # noise on each), weighted as Adam would weight them, by 1 / their size. Unrotated, stochastic
    # rounding gives a value x far below its group's step s a noise of variance |x| s; rotated,
    # every element of the block gets the spike's share, (s / sqrt(32))^2 / 6: it costs the tiny
    # ones only where they lie more than about 10^3 below the spike.
    size = torch.full((numel,), 1e-5)
    size[::32] = 1.0
    noise = torch.randn(world, numel, generator=torch.Generator().manual_seed(2))
    spiky = size * (1 + 0.1 * noise) / world
    measured = _measure(errors, spiky, local, adam=1 / size)["all"]
    assert measured["two_level_error"]["tlq_hs"] < 2 * measured["two_level_error"]["tlq"]
    assert measured["adam"]["two_level_error"]["tlq_hs"] > 3 * measured["adam"]["two_level_error"]["tlq"]


def test_errors_are_measured_against_the_exact_mean(errors):
    world, local, numel = 8, 2, 8 * 256
    constant = torch.arange(1, world + 1, dtype=torch.float32)[:, None].expand(world, numel).contiguous() / world
    before = constant.clone()
    lossless = _measure(errors, constant, local)
    assert torch.equal(constant, before)
    for group in ("a", "b", "all"):
        assert lossless[group]["two_level_error"]["tlq"] < 1e-6
        assert lossless[group]["two_level_error"]["tlq_hs"] < 1e-6
        assert lossless[group]["int4_error"]["plain"] < 1e-6

    grads = torch.randn(world, numel, generator=torch.Generator().manual_seed(0)) / world
    measured = _measure(errors, grads, local)
    exact = grads.double().sum(0)
    for name, config in (("tlq", errors.TLQ), ("tlq_hs", errors.TLQ_HS)):
        estimate = errors.two_level_mean(grads, local, config, step=3, bucket=0).double()
        assert measured["all"]["two_level_error"][name] == pytest.approx(_relative(estimate, exact), rel=1e-9)
        assert measured["b"]["two_level_error"][name] == pytest.approx(
            _relative(estimate[numel // 2 :], exact[numel // 2 :]), rel=1e-9
        )
        assert 0.01 < measured["all"]["two_level_error"][name] < 0.5
    spread = ((grads.double() * world - exact).square().sum() / (world * (world - 1))).sqrt()
    assert measured["all"]["batch_noise"] == pytest.approx((spread / exact.norm()).item(), rel=1e-9)
    # Rank r's window alone gives r (r = 1..8), their mean 4.5: sqrt(sum (r - 4.5)^2 / (8 * 7)) / 4.5.
    assert lossless["all"]["batch_noise"] == pytest.approx(math.sqrt(42 / 56) / 4.5)
    assert measured["a"]["elements"] == numel // 2 and measured["all"]["grad_share"] == 1.0


def test_group_sums_add_up_each_groups_runs(errors):
    labels = torch.tensor([2, 2, 0, 0, 0, 1, 2, 2, 3])  # group 2 in two runs; 3: the padding
    runs = errors.Runs.of(labels)
    assert runs.bounds.tolist() == [0, 2, 5, 6, 8, 9] and runs.labels.tolist() == [2, 0, 1, 2, 3]
    tally = errors.Tally(["a", "b", "c"])
    tally.add_squares("x", runs, torch.arange(9.0))
    assert tally.sums["x"].tolist() == [4 + 9 + 16, 25, 0 + 1 + 36 + 49, 64]


def test_group_shape(errors, benchmark_script):
    spike, constant, zeros = torch.zeros(128), torch.full((128,), -0.5), torch.zeros(128)
    spike[7] = 3e-12  # a gradient divided by W can be this small: x^4 would underflow fp32
    crest, kurtosis = errors.group_shape(torch.cat([spike, constant, zeros]), 128)
    assert crest[0].item() == pytest.approx(math.sqrt(128)) and kurtosis[0].item() == pytest.approx(128)
    assert crest[1].item() == pytest.approx(1.0) and kurtosis[1].item() == pytest.approx(1.0)
    assert crest[2].isnan() and kurtosis[2].isnan()

    diagnostic = benchmark_script("hadamard_diagnostic")
    from gpt.model import GPT, GPTConfig

    names = [name for name, _ in GPT(GPTConfig(n_layer=2)).named_parameters()]
    assert {diagnostic.GROUPS[diagnostic.group_of(name)] for name in names} == set(diagnostic.GROUPS)
    with pytest.raises(ValueError, match="'head.bias' is in none of"):
        diagnostic.group_of("head.bias")


def test_the_kernel_timing_runs_the_presets_kernels(benchmark_script, monkeypatch):
    diagnostic = benchmark_script("hadamard_diagnostic")
    from lightning_sdp4bit import kernels
    from lightning_sdp4bit.buffers import BucketLayout
    from lightning_sdp4bit.reference.ops import payload_row_bytes, torch_grad_decode_sum

    decoded = []  # (payload, hadamard size, the kernel's shard)
    decode = kernels.grad_decode_sum

    def recording(payload, bits, group, size, out):
        decoded.append((payload, size, decode(payload, bits, group, size, out).clone()))
        return out

    monkeypatch.setattr(kernels, "grad_decode_sum", recording)
    nodes, local, shard, calls = 2, 2, 256, []

    def timer(fn):
        calls.append(fn())
        return float(len(calls))

    times = diagnostic._time_bucket(
        timer, BucketLayout(0, torch.float32, nodes * local, shard, ()), nodes, local, torch.device("cpu")
    )
    assert times == {"encode_ms": {0: 1.0, 32: 3.0}, "decode_ms": {0: 2.0, 32: 4.0}}
    plain, rotated = calls[0], calls[2]
    assert plain.shape == rotated.shape == (local, payload_row_bytes(nodes * shard, 8, 128))
    assert not torch.equal(plain, rotated)
    assert [size for _, size, _ in decoded] == [0, 32]
    for payload, size, shard_values in decoded:
        assert payload.shape == (nodes, payload_row_bytes(shard, 4, 128))
        assert torch.equal(shard_values, torch_grad_decode_sum(payload, 4, 128, size))


def _diagnose(*args: str) -> str:
    result = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_smoke_run_measures_resumes_and_reports(tmp_path, benchmark_script):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _diagnose("--smoke", "--steps", "1,4", "--out", str(straight / "out"), "--state", str(straight / "state"))
    _diagnose("--smoke", "--steps", "1", "--out", str(resumed / "out"), "--state", str(resumed / "state"))
    out = _diagnose("--smoke", "--steps", "1,4", "--out", str(resumed / "out"), "--state", str(resumed / "state"))
    assert "bytes: resumed at step 1" in out and "bpe: resumed at step 1" in out
    first = json.loads((straight / "out" / "hadamard_diagnostic.json").read_text())
    again = json.loads((resumed / "out" / "hadamard_diagnostic.json").read_text())
    assert [(c["vocab"], c["step"]) for c in first["captures"]] == [("bytes", 1), ("bpe", 1), ("bytes", 4), ("bpe", 4)]
    for a, b in zip(first["captures"], again["captures"], strict=True):
        assert (a["loss"], a["groups"]) == (b["loss"], b["groups"])
    assert first["captures"][2]["loss"] < first["captures"][0]["loss"]  # it trained
    assert all("adam" in group for capture in first["captures"] for group in capture["groups"].values())
    assert first["kernels"] is None  # timed on a GPU only
    tokenizer = (straight / "out" / "bpe_tokenizer.json").read_bytes()
    import hashlib

    assert hashlib.sha256(tokenizer).hexdigest() == first["corpus"]["bpe"]["tokenizer_sha256"]
    assert first["captures"][1]["vocab_size"] == first["corpus"]["bpe"]["tokenizer_vocab"] > 256

    out = _diagnose("--smoke", "--steps", "1,4", "--out", str(tmp_path / "again"), "--state", str(straight / "state"))
    assert "nothing pending" in out
    assert json.loads((tmp_path / "again" / "hadamard_diagnostic.json").read_text()) == first

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "hadamard.md").write_text(
        "placeholder\n<!-- Notes below this line are kept when the report is rewritten. -->\nkept notes\n"
    )
    _diagnose("--report", str(straight / "out" / "hadamard_diagnostic.json"), "--docs", str(docs))
    page = (docs / "hadamard.md").read_text()
    assert "placeholder" not in page and page.endswith("\nkept notes\n")
    assert first["corpus"]["bpe"]["tokenizer_sha256"] in page
    for vocab, step in (("bytes", 1), ("BPE", 4)):
        assert f"| {vocab} | {step} |" in page
    assert "| BPE | 4 | embedding |" in page and "Kernel times: **pending the H200 run**" in page
    adam_table = page.split("## Errors as Adam sees them", 1)[1].split("##", 1)[0]
    rows = [line for line in adam_table.splitlines() if line.startswith(("| bytes |", "| BPE |"))]
    assert len(rows) == 4 * 6 and rows[0].startswith("| bytes | 1 |") and rows[-1].startswith("| BPE | 4 |")
    assert (docs / "hadamard.png").stat().st_size > 0

    # Two calls' outputs in one report: all the captures, in order; not of two tokenizers.
    merge = benchmark_script("hadamard_report").merge
    early = {**first, "captures": first["captures"][:2], "steps": [1]}
    late = {**first, "captures": first["captures"][2:], "steps": [4]}
    assert merge([late, early]) == first
    other = json.loads(json.dumps(late))
    other["corpus"]["bpe"]["tokenizer_sha256"] = "0" * 64
    with pytest.raises(SystemExit, match="differ in bpe tokenizer_sha256"):
        merge([early, other])

    # What a GPU run adds: each bucket's kernel times (JSON keys are strings) and their sum a step.
    rows = [{"vocab": v, "bucket": 0, "numel": 1024, "encode_ms": {"0": 0.1, "32": 0.13},
             "decode_ms": {"0": 0.02, "32": 0.03}} for v in ("bytes", "bpe")]  # fmt: skip
    per_step = {v: {"encode_0": 0.1, "encode_32": 0.13, "decode_0": 0.02, "decode_32": 0.03} for v in ("bytes", "bpe")}
    timed = tmp_path / "timed.json"
    timed.write_text(json.dumps({**first, "kernels": {"rows": rows, "per_step_ms": per_step, "device": "H200"}}))
    _diagnose("--report", str(timed), "--docs", str(docs))
    page = (docs / "hadamard.md").read_text()
    pass_ms = first["captures"][-1]["rank_pass_ms"]
    assert "| BPE | 0 | 1,024 | 0.100 | 0.130 | 0.020 | 0.030 |" in page
    assert "- BPE: the rotation adds **40 us a step** to a rank's encode and decode (120 us without it), " in page
    assert f"{100 * 0.04 / pass_ms:.2f}% of a rank's forward and backward ({pass_ms:.1f} ms)" in page
