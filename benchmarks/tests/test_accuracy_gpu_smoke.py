"""The GPU accuracy study's script (benchmarks/accuracy_gpu.py --smoke) on CPU, as CI runs it:
- a tiny GPT trains as a simulated 2 x 2 job on the installed packages' source files and its
  held-out validation loss falls;
- a run stopped by its time budget saves its state and, resumed, ends with the straight run's
  final validation loss bit for bit (the study spans many device calls);
- the report has a row per preset (finished or pending) and the corpus's hashes, and the plot exists;
- a run name outside the study, a negative budget or no seeds stop the script before anything is
  read or trained, naming the flag;
- on a BPE vocabulary (--tokenizer bpe) the tiny GPT trains on the tokenizer's ids for the byte
  study's share of the corpus in BPE tokens, its result records the vocabulary and the tokenizer
  file's SHA-256, its state file is its own (not a byte run's name), and its report is
  accuracy_gpu_bpe.md, in nats per token;
- a study that needs more windows than the corpus holds takes a second pass in a new order, and
  one that does not keeps the single permutation the byte runs were trained with.
"""

import hashlib
import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "accuracy_gpu.py"


def _study(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", *args], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_smoke_study_trains_resumes_exactly_and_reports(tmp_path):
    straight, resumed, docs = tmp_path / "straight", tmp_path / "resumed", tmp_path / "docs"
    _study("--runs", "baseline-d0,sdp4bit-r0", "--results", str(straight), "--state", str(tmp_path / "s1"))
    out = _study("--runs", "sdp4bit-r0", "--results", str(resumed), "--state", str(tmp_path / "s2"), "--budget", "0")
    assert "out of budget at step" in out and not (resumed / "sdp4bit-r0.json").exists()
    out = _study("--runs", "sdp4bit-r0", "--results", str(resumed), "--state", str(tmp_path / "s2"))
    assert "sdp4bit-r0: resumed at step" in out

    first = json.loads((straight / "sdp4bit-r0.json").read_text())
    again = json.loads((resumed / "sdp4bit-r0.json").read_text())
    assert again["final_val_loss"] == first["final_val_loss"]
    assert again["val_curve"] == first["val_curve"]
    curve = [loss for _, loss in first["val_curve"]]
    assert curve[-1] < curve[0] - 0.3 and curve[0] < math.log(256) + 0.5
    assert first["bits_per_element"]["grad_inter_bits_per_element"] == 4 + 32 / 128
    assert first["corpus"]["val_files"] > 0 and len(first["corpus"]["content_sha256"]) == 64

    docs.mkdir()
    _study("--report", "--results", str(straight), "--docs", str(docs))
    report = (docs / "accuracy_gpu.md").read_text()
    assert "| sdp4bit | 1 |" in report and "| qw | pending |" in report
    assert first["corpus"]["file_list_sha256"] in report
    assert (docs / "accuracy_gpu.png").stat().st_size > 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--runs", "qw-r1,qw-r5"], "--runs: 'qw-r5' not in the study; with --seeds 2 its runs are baseline-d0, "),
        (["--runs", "nonsense"], "--runs: 'nonsense' not in the study"),
        (["--runs", "baseline-r0"], "--runs: 'baseline-r0' not in the study"),  # the baseline varies its data order
        (["--budget", "-1"], "--budget must be at least 0 seconds, got -1"),
        (["--seeds", "0"], "--seeds must be at least 1, got 0"),
    ],
)
def test_bad_arguments_name_the_flag_before_anything_is_read(args, message, tmp_path, capsys, benchmark_script):
    accuracy_gpu = benchmark_script("accuracy_gpu")
    with pytest.raises(SystemExit) as stopped:
        accuracy_gpu.main([*args, "--results", str(tmp_path / "results"), "--state", str(tmp_path / "state")])
    assert stopped.value.code == 2 and message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing written


def test_a_limited_corpus_reads_on_to_its_first_held_out_file(tmp_path, benchmark_script):
    """A smoke corpus stops at its byte limit only once a file is held out for validation: on the
    H200 machine the first 2 MB in sorted order held 43 files, none of them held out."""
    import hashlib

    corpus = benchmark_script("corpus")
    names = [f"m{i:03d}.py" for i in range(400)]
    held_out = [hashlib.sha256(f"0:{n}".encode()).digest()[0] < 4 for n in names]
    first = held_out.index(True)
    assert first >= 3  # the limit below is reached before it
    for name in names[: first + 3]:
        (tmp_path / name).write_bytes(b"x = 1\n" * 100)
    built = corpus.build_corpus([tmp_path], limit_bytes=1000)
    assert built.manifest["val_files"] == 1 and built.manifest["files"] == first + 1
    assert len(built.val) > 0 and len(built.train) > 0


def test_smoke_study_on_a_bpe_vocabulary(tmp_path, benchmark_script):
    results, state, docs = tmp_path / "results", tmp_path / "state", tmp_path / "docs"
    common = ["--tokenizer", "bpe", "--results", str(results), "--state", str(state)]
    _study("--runs", "baseline-d0", *common)
    run = json.loads((results / "baseline-d0.json").read_text())
    vocab = run["corpus"]["tokenizer_vocab"]
    assert run["study"]["vocab_size"] == vocab and 256 < vocab <= 384
    byte_study = benchmark_script("accuracy_gpu").SMOKE
    share = byte_study.tokens / run["corpus"]["train_bytes"]  # of the byte corpus
    assert run["study"]["tokens"] == round(share * run["corpus"]["train_tokens"]) < byte_study.tokens
    tokenizer = Path(run["corpus"]["tokenizer_file"]).read_bytes()
    assert hashlib.sha256(tokenizer).hexdigest() == run["corpus"]["tokenizer_sha256"]
    curve = [loss for _, loss in run["val_curve"]]
    # 14 steps (the byte smoke's 24 as a share of the corpus): it fell 0.115 on the CPU, 0.085 in bf16 on the H200
    assert curve[0] < math.log(vocab) + 0.5 and curve[-1] < curve[0] - 0.05

    out = _study("--runs", "tlq-r0", "--budget", "0", *common)
    assert "out of budget at step" in out and (state / f"tlq-r0-v{vocab}.pt").exists()
    assert not (state / "tlq-r0.pt").exists()  # the name of a byte run's state

    docs.mkdir()
    _study("--report", *common, "--docs", str(docs))
    report = (docs / "accuracy_gpu_bpe.md").read_text()
    assert run["corpus"]["tokenizer_sha256"] in report and "nats per token" in report
    assert "| baseline | 1 |" in report and f"vocabulary {vocab}" in report
    assert (docs / "accuracy_gpu_bpe.png").stat().st_size > 0


def test_a_study_longer_than_its_corpus_takes_a_second_pass(benchmark_script):
    accuracy_gpu = benchmark_script("accuracy_gpu")
    study = replace(accuracy_gpu.SMOKE, tokens=96 * 64)  # 24 steps of 4 windows of 64 tokens
    device = torch.device("cpu")

    def order(windows: int):
        corpus = SimpleNamespace(train=torch.zeros(windows * 64 + 1, dtype=torch.int32), val=torch.zeros(65))
        return accuracy_gpu.Data(corpus, study, 7, device)

    single = torch.randperm(96, generator=torch.Generator().manual_seed(7))
    enough = order(96)
    assert enough.epochs == 1 and torch.equal(enough.order, single)  # the byte runs' order, unchanged
    short = order(50)
    first = torch.randperm(50, generator=torch.Generator().manual_seed(7))
    assert short.epochs == 2 and torch.equal(short.order[:50], first)
    assert torch.equal(short.order[50:].sort().values, torch.arange(50)) and not torch.equal(short.order[50:], first)
