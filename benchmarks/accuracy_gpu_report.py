"""The GPU accuracy study's two outputs beside training (benchmarks/accuracy_gpu.py):
- `measure_throughput`: tokens/s and peak memory of the simulated W-rank job against a plain
  single-GPU step of the same global batch;
- `write_report`: docs/accuracy_gpu.md (final validation loss per preset against the baseline and
  the paper's 125M row, seed spread, noise floor, verdicts) and docs/accuracy_gpu.png (the curves);
  docs/accuracy_gpu_bpe.md and .png for the study on a BPE vocabulary.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

# Paper, Table 1, GPT-125M on the Pile after about 42B tokens: final validation loss.
PAPER_125M = {"baseline": 2.29392, "qw": 2.57312, "qwd": 2.29274, "tlq": 2.30479, "tlq_hs": 2.29528, "sdp4bit": 2.29590}
ORDER = ["baseline", "qw", "qwd", "ulq", "tlq", "tlq_hs", "sdp4bit"]
NOTES_MARKER = "<!-- Notes below this line are kept when the report is rewritten. -->"


def _timed_steps(step, count: int, device: torch.device) -> float:
    """Seconds per call of `step()`, over `count` calls back to back after two warm-ups."""
    for _ in range(2):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(count):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / count


def _step_of(study, preset: str | None, device: torch.device):
    """(one training step as a function, the model's parameter count): the simulated job under
    `preset`, or with None a plain step (the module's own parameters, the whole global batch in
    one pass, one fused AdamW)."""
    from accuracy_gpu import RankPasses, build, loss_of

    model, engine, _, _ = build(study, preset or "baseline", 0, device)
    x = torch.randint(0, study.vocab_size, (study.ranks * study.batch_per_rank, study.block_size + 1), device=device)
    params = sum(p.numel() for p in model.parameters())
    if preset is None:
        plain = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

        def plain_step():
            loss_of(model, x).backward()
            plain.step()
            plain.zero_grad()

        return plain_step, params
    b = study.batch_per_rank
    passes = RankPasses(model, engine, x[:b], graphed=device.type == "cuda")

    micro_batches = x.view(study.ranks, b, -1)
    losses = torch.zeros((), device=device)

    def simulated_step():
        passes.step(micro_batches, losses)
        engine.optimizer_step(max_norm=1.0)

    return simulated_step, params


def measure_throughput(study, device: torch.device, results: Path, count: int = 5) -> None:
    """Print and save (results/throughput.json) tokens/s and peak memory: the simulated job for two
    presets, and a plain step of the same global batch."""
    tokens = study.ranks * study.batch_per_rank * study.block_size
    rows = []
    for preset in ["baseline", "sdp4bit", None]:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        step, params = _step_of(study, preset, device)
        seconds = _timed_steps(step, count, device)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        name = f"simulated {study.world}, {preset}" if preset else "plain, one GPU"
        rows.append(
            {"run": name, "step_s": seconds, "tokens_per_s": tokens / seconds, "peak_gib": peak, "params": params}
        )
        del step
    print("| run | step (ms) | tokens/s | vs plain | peak memory (GiB) |\n|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['run']} | {1e3 * row['step_s']:.1f} | {row['tokens_per_s']:,.0f} | "
            f"{row['tokens_per_s'] / rows[-1]['tokens_per_s']:.3f} | {row['peak_gib']:.1f} |"
        )
    results.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    (results / "throughput.json").write_text(json.dumps({"device": device_name, "rows": rows}, indent=1))


def _finished(results: Path) -> dict[str, list[dict]]:
    by_preset: dict[str, list[dict]] = {}
    for path in sorted(results.glob("*-[rd][0-9]*.json")):
        run = json.loads(path.read_text())
        by_preset.setdefault(run["preset"], []).append(run)
    return by_preset


def _verdicts(means: dict[str, float], spreads: dict[str, float | None], noise: float | None) -> list[str]:
    """The paper's orderings, judged on the finished runs, or pending. A
    "within x% of baseline" verdict whose line lies closer to the measured value than the noise
    (the preset's seed spread or the data-order floor, whichever is wider) says so. A preset of
    one run has no seed spread (None): the ordering that needs one stays pending."""

    def judge(needs: list[str], holds, text: str, near: str = "") -> str:
        if any(p not in means for p in needs) or (noise is None and "floor" in text):
            return f"- {text}: **pending** (needs {', '.join(needs)})"
        return f"- {text}: **{'holds' if holds() else 'does not hold'}**{near and f' ({near})'}"

    base = means.get("baseline", float("nan"))

    def within(preset: str, limit: float, two_sided: bool, text: str) -> str:
        """`preset` within `limit` of baseline (|off| <= limit if two_sided, else off <= limit),
        judged, with a note when the line lies nearer the measured value than the noise."""
        if preset not in means or "baseline" not in means:
            return judge(["baseline", preset], lambda: False, text)
        off = means[preset] / base - 1
        distance = limit - (abs(off) if two_sided else off)  # > 0: inside the line
        seeds, floor = (spreads[preset] or 0.0) / base, (noise or 0.0) / base
        near = ""
        if abs(distance) < max(seeds, floor):
            which = "seed spread" if seeds >= floor else "noise floor"
            near = (
                f"{off:+.3%}; the {limit:.2%} line is nearer than the {which}, {max(seeds, floor):.2%}: "
                "these runs do not decide it"
            )
        return judge(["baseline", preset], lambda: distance >= 0, text, near)

    tlq_text = "TLq worse than TLq-HS by more than their seed spread"
    if {"tlq", "tlq_hs"} <= means.keys():  # how far apart, beside the paper's figure
        gap = f"TLq {means['tlq'] - means['tlq_hs']:+.5f} nats against TLq-HS"
        if spreads["tlq"] is None or spreads["tlq_hs"] is None:
            tlq = f"- {tlq_text}: **pending** (one run of tlq or tlq_hs: no seed spread; {gap}; the paper 0.0095)"
        else:
            spread = max(spreads["tlq"], spreads["tlq_hs"])
            verdict = "holds" if means["tlq"] - means["tlq_hs"] > spread else "does not hold"
            tlq = f"- {tlq_text}: **{verdict}** ({gap}; seed spread {spread:.5f}; the paper 0.0095)"
    else:
        tlq = judge(["tlq", "tlq_hs"], lambda: False, tlq_text)
    return [
        judge(
            ["baseline", "qw"],
            lambda: means["qw"] - base > 10 * noise,
            "qW worse than baseline by more than 10x the noise floor",
        ),
        within("qwd", 0.001, True, "qWD within 0.1% of baseline"),
        tlq,
        judge(["ulq", "tlq"], lambda: means["ulq"] > means["tlq"], "ULq worse than TLq"),
        within("sdp4bit", 0.0025, False, "SDP4Bit within 0.25% of baseline"),
    ]


def _spread_text(spread: float | None) -> str:
    return "one run" if spread is None else f"{spread:.5f}"


def _vocabulary(run: dict) -> tuple[str, str, str]:
    """(the model's vocabulary and size, the tokenizer in a few words, the loss's unit) of a run."""
    study, corpus = run["study"], run["corpus"]
    vocab, width, layers = study.get("vocab_size", 256), study["n_embd"], study["n_layer"]
    # GPT's parameters: embeddings (tokens, positions), per block 12 C^2 + 13 C, the final norm.
    params = vocab * width + study["block_size"] * width + layers * (12 * width**2 + 13 * width) + 2 * width
    if vocab == 256:
        return f"byte tokens, {params / 1e6:.1f}M parameters", "bytes", "nats per byte"
    tokenizer = f"byte-level BPE of {vocab:,} tokens, SHA-256 `{corpus['tokenizer_sha256']}`"
    return f"BPE tokens, vocabulary {vocab:,}, {params / 1e6:.1f}M parameters", tokenizer, "nats per token"


def write_report(results: Path, docs: Path, page: str = "accuracy_gpu") -> None:
    """docs/<page>.md and .png from every finished run in `results` (the others: pending)."""
    from accuracy_gpu import PRESETS, run_names

    runs = _finished(results)
    if not runs:
        raise SystemExit(f"no finished run in {results}")
    base_runs = [r for r in runs.get("baseline", []) if r["data_seed"] == 0]
    base = base_runs[0]["final_val_loss"] if base_runs else None
    floor = [r["final_val_loss"] for r in runs.get("baseline", [])]
    noise = max(floor) - min(floor) if len(floor) > 1 else None
    lines = [
        "| preset | runs | final val loss (mean) | vs baseline (nats) | vs baseline | seed spread (nats) | each run "
        "| paper 125M |",
        "|---|---|---|---|---|---|---|---|",
    ]
    means: dict[str, float] = {}
    spreads: dict[str, float | None] = {}
    for preset in ORDER:
        pool = [r for r in runs.get(preset, []) if preset != "baseline" or r["data_seed"] == 0]
        paper = PAPER_125M.get(preset)
        paper_text = f"{paper:.5f} ({100 * (paper / PAPER_125M['baseline'] - 1):+.2f}%)" if paper else "not in Table 1"
        if not pool:
            lines.append(f"| {preset} | pending | | | | | | {paper_text} |")
            continue
        losses = [r["final_val_loss"] for r in pool]
        means[preset] = statistics.mean(losses)
        spreads[preset] = max(losses) - min(losses) if len(losses) > 1 else None
        delta = (
            f"{means[preset] - base:+.5f} | {100 * (means[preset] / base - 1):+.3f}%" if base else "pending | pending"
        )
        each = ", ".join(f"{r['run']} {r['final_val_loss']:.5f}" for r in pool)
        lines.append(
            f"| {preset} | {len(losses)} | {means[preset]:.5f} | {delta} | {_spread_text(spreads[preset])} | {each} "
            f"| {paper_text} |"
        )
    first = next(iter(runs.values()))[0]
    vocabulary, tokenizer, unit = _vocabulary(first)
    flag = "" if page == "accuracy_gpu" else " --tokenizer bpe"
    names = run_names(PRESETS, 2)
    done = sorted(r["run"] for pool in runs.values() for r in pool)
    header = [
        "# Accuracy on one GPU: the paper's Table 1 at the GPT-125M shape, on real text",
        "",
        "Every run is a job of 16 nodes x 4 ranks simulated on one H200 (`lightning_sdp4bit.simulation`; "
        "each rank's forward and backward replayed from a CUDA graph): the same 12 x 768 GPT (12 heads, "
        f"{first['study']['block_size']} tokens of context, {vocabulary}), the same initial "
        f"weights, data order and budget: {first['tokens']:,} tokens in {first['steps']} steps of 64 x 1 x "
        f"{first['study']['block_size']}; AdamW (0.9, 0.95), weight decay 0.1, lr {first['study']['lr']} with "
        f"{100 * first['study']['warmup_fraction']:.0f}% warm-up and a cosine to {first['study']['min_lr']}, "
        "clipping at 1.0, bf16 weights; nothing tuned per preset.",
        "",
        f"- command: `python benchmarks/accuracy_gpu.py{flag} --runs all --budget 540` on the device machine, repeated "
        "until every run is finished (each run checkpoints on the machine's disk and resumes), then "
        f"`python benchmarks/accuracy_gpu.py{flag} --report`; results in `benchmarks/results/{page}/`",
        f"- corpus: {first['corpus']['files']:,} source and documentation files of the device machine's "
        f"installed Python packages ({', '.join(first['corpus']['roots'])}), "
        f"{first['corpus']['train_bytes']:,} training bytes and {first['corpus']['val_bytes']:,} bytes of "
        f"held-out validation files; file list SHA-256 `{first['corpus']['file_list_sha256']}`, content "
        f"SHA-256 `{first['corpus']['content_sha256']}`; tokenizer: {tokenizer}",
        f"- final validation loss: {unit} over the first {first['final_val_tokens']:,} held-out tokens",
        *(
            [f"- data: {first['data_epochs']} passes over the training tokens, each in a new order"]
            if first.get("data_epochs", 1) > 1
            else []
        ),
        f"- machine: {first['device']}, torch {first['torch']}",
        f"- finished runs ({len(done)} of {len(names)}): {', '.join(done)}; pending: "
        f"{', '.join(n for n in names if n not in done) or 'none'}",
        "- noise floor (baseline with another data order, baseline-d1): "
        + (f"{noise:.5f} nats" if noise is not None else "pending"),
        "",
    ]
    verdicts = [
        "",
        "What the paper leads us to expect, judged on these numbers:",
        "",
        *_verdicts(means, spreads, noise),
    ]
    figure = ["", f"![validation curves]({page}.png)", "", NOTES_MARKER]
    report = docs / f"{page}.md"
    kept = report.read_text().split(NOTES_MARKER, 1) if report.exists() else []
    report.write_text("\n".join(header + lines + verdicts + figure) + (kept[1] if len(kept) == 2 else "\n"))
    _plot(runs, docs / f"{page}.png", unit)


def _plot(runs: dict[str, list[dict]], path: Path, unit: str, from_step: int = 1000) -> None:
    """Left: every run's validation curve. Right: from `from_step` on, each run against the first
    baseline run at the same step, in %, where the presets' differences (0.1-1%) show. One colour
    a preset, the same in both; a preset's first run solid, its second dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (whole, late) = plt.subplots(1, 2, figsize=(12, 5))
    colours = dict(zip(ORDER, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    reference = dict(runs["baseline"][0]["val_curve"]) if runs.get("baseline") else {}
    for preset in ORDER:
        for index, run in enumerate(runs.get(preset, [])):
            style = {"color": colours[preset], "linestyle": "-" if index == 0 else "--", "linewidth": 1}
            steps, losses = zip(*run["val_curve"], strict=True)
            whole.plot(steps, losses, label=run["run"], **style)
            later = [(step, loss) for step, loss in run["val_curve"] if step >= from_step and step in reference]
            if later:
                x, y = zip(*[(step, 100 * (loss / reference[step] - 1)) for step, loss in later], strict=True)
                late.plot(x, y, label=run["run"], **style)
    whole.set_xlabel("optimizer step")
    whole.set_ylabel(f"validation loss ({unit})")
    whole.set_ylim(
        top=min(3.0 if unit == "nats per byte" else 8.0, whole.get_ylim()[1])
    )  # the first evaluations off the scale
    late.set_xlabel("optimizer step")
    late.set_ylabel(f"validation loss against {runs['baseline'][0]['run'] if reference else 'the baseline'} (%)")
    late.axhline(0.0, color="black", linewidth=0.5)
    late.set_yscale("symlog", linthresh=1.0)  # qW sits near +12%, the rest within +-1%
    late.set_yticks([-0.5, 0, 0.5, 1, 2, 5, 10, 20])
    late.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    late.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
