"""Short runs of the GPU accuracy study with another warm-up or peak learning rate, and how much of
the averaged gradient arrives as exactly 0: is a preset's lead over the baseline the compression's,
or the schedule's? (docs/hadamard.md, "TLq below the baseline").

    python benchmarks/accuracy_probe.py --tokenizer bpe --runs tlq:0.02:6e-4,baseline:0.075:6e-4 --out OUT
    python benchmarks/accuracy_probe.py --report OUT/accuracy_probe.json     # the Markdown table
    python benchmarks/accuracy_probe.py --smoke --runs tlq:0.02:6e-4 --out /tmp/p   # CI, on CPU

A run is PRESET:WARMUP:LR: the study's model, initial weights, data order and schedule
(benchmarks/accuracy_gpu.py, rounding seed 0, data order 0), with the warm-up as a fraction of the
study's steps and the peak learning rate replaced (the floor stays a tenth of it), trained for
--steps of them. It records the validation loss at half and at all of --steps (the study's 256
windows), and, at a few steps, the fraction of every rank's averaged gradient shard that is
exactly 0 when its optimizer steps. A finished run is written to OUT/accuracy_probe.json at
once, and skipped by a later call.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "benchmarks")]

from accuracy_gpu import PRESETS, SMOKE, SMOKE_BPE_VOCAB, Data, RankPasses, Study, bpe_study, build  # noqa: E402
from bpe import BPE_VOCAB, bpe_corpus  # noqa: E402
from corpus import build_corpus  # noqa: E402

ZERO_STEPS = (5, 20)  # and half and the last of --steps


def parse_run(spec: str) -> tuple[str, float, float]:
    """'tlq:0.02:6e-4' -> ('tlq', 0.02, 0.0006), checked."""
    parts = spec.split(":")
    try:
        preset, warmup, lr = parts[0], float(parts[1]), float(parts[2])
    except (IndexError, ValueError):
        raise ValueError(f"run {spec!r}: expected PRESET:WARMUP:LR, e.g. 'tlq:0.02:6e-4'") from None
    if len(parts) != 3 or preset not in PRESETS:
        raise ValueError(f"run {spec!r}: expected PRESET:WARMUP:LR with PRESET one of {PRESETS}")
    if not 0 <= warmup < 1 or not 0 < lr < 1:
        raise ValueError(f"run {spec!r}: the warm-up is a fraction of the steps in [0, 1), the peak lr in (0, 1)")
    return preset, warmup, lr


def count_zeros(engine, into: dict, step: list[int], record: set[int]) -> None:
    """Before each rank's optimizer step at a step in `record`, add its gradient shards' exact
    zeros and elements to into[step] (the clip scales the shards; it makes no zeros)."""

    def hook(optimizer, args, kwargs) -> None:
        if step[0] not in record:
            return
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        zeros, total = into.setdefault(step[0], [0, 0])
        into[step[0]] = [zeros + sum(int((g == 0).sum()) for g in grads), total + sum(g.numel() for g in grads)]

    for rank in engine.ranks:
        for optimizer in rank.optimizers:
            optimizer.register_step_pre_hook(hook)


def probe(spec: str, study: Study, corpus, steps: int, device: torch.device) -> dict:
    preset, warmup, lr = parse_run(spec)
    study = replace(study, warmup_fraction=warmup, lr=lr, min_lr=lr / 10)
    started = time.time()
    data = Data(corpus, study, 0, device)
    model, engine, _, schedule = build(study, preset, 0, device)
    passes = RankPasses(model, engine, data.batches(0)[0], graphed=device.type == "cuda")
    zeros: dict = {}
    current = [0]
    count_zeros(engine, zeros, current, {*ZERO_STEPS, steps // 2, steps - 1})
    val, train = {}, torch.zeros((), device=device)
    for step in range(steps):
        if step == steps // 2:
            val[step] = data.evaluate(model, study.eval_windows)
        current[0] = step
        passes.step(data.batches(step), train)
        engine.optimizer_step(study.clip)
        schedule.step()
    val[steps] = data.evaluate(model, study.eval_windows)
    return {
        "run": spec, "preset": preset, "warmup_fraction": warmup, "warmup_steps": max(1, round(warmup * study.steps)),
        "lr": lr, "steps": steps, "study_steps": study.steps, "val": val,
        "train_loss": train.item() / (steps * study.ranks),
        "zero_fraction": {step: z / n for step, (z, n) in sorted(zeros.items())},
        "seconds": round(time.time() - started, 1), "vocab_size": study.vocab_size,
    }  # fmt: skip


def report(results: list[dict]) -> str:
    """The Markdown table of finished runs."""
    lines = [
        "| run | preset | warm-up (steps) | peak lr | val, half-way | val, last step | train loss (mean) "
        "| gradient exactly 0, by step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        (half, first), (last, final) = sorted((int(k), v) for k, v in r["val"].items())
        zeros = ", ".join(f"{step}: {100 * f:.1f}%" for step, f in r["zero_fraction"].items())
        lines.append(
            f"| `{r['run']}` | {r['preset']} | {r['warmup_steps']} | {r['lr']:g} | {first:.4f} (step {half}) | "
            f"{final:.4f} (step {last}) | {r['train_loss']:.4f} | {zeros} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="", help="comma-separated PRESET:WARMUP:LR")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps of each run")
    parser.add_argument("--out", type=Path, help="where accuracy_probe.json is written")
    parser.add_argument("--tokenizer", choices=["bytes", "bpe"], default="bpe", help="the vocabulary")
    parser.add_argument("--state", type=Path, default=Path("/tmp/sdp4bit_accuracy_gpu_bpe"), help="BPE cache")
    parser.add_argument("--smoke", action="store_true", help="a tiny model for a few steps (CI, CPU)")
    parser.add_argument("--report", type=Path, help="print the table of an accuracy_probe.json")
    args = parser.parse_args(argv)
    if args.report is not None:
        print(report(json.loads(args.report.read_text())))
        return
    specs = [s for s in args.runs.split(",") if s]
    try:
        for spec in specs:
            parse_run(spec)
    except ValueError as error:
        parser.error(f"--runs: {error}")
    if not specs or args.out is None:
        parser.error("--runs and --out are required (or --report)")
    study = SMOKE if args.smoke else Study()
    if not 2 <= args.steps <= study.steps:
        parser.error(f"--steps must lie in 2..{study.steps}, got {args.steps}")
    path = args.out / "accuracy_probe.json"
    results = json.loads(path.read_text()) if path.exists() else []
    pending = [s for s in specs if s not in {r["run"] for r in results}]
    print(f"pending: {pending}", flush=True)
    if not pending:
        return
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    corpus = build_corpus(limit_bytes=study.corpus_limit_bytes)
    if args.tokenizer == "bpe":
        corpus = bpe_corpus(corpus, SMOKE_BPE_VOCAB if args.smoke else BPE_VOCAB, args.state)
        study = bpe_study(study, corpus.manifest)
    args.out.mkdir(parents=True, exist_ok=True)
    for spec in pending:
        results.append(probe(spec, study, corpus, args.steps, device))
        path.write_text(json.dumps(results, indent=1))
        print(json.dumps(results[-1]), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
