"""docs/hadamard.md and docs/hadamard.png from the Hadamard diagnostic's output
(benchmarks/hadamard_diagnostic.py --report OUT/hadamard_diagnostic.json): the tables of errors,
group shapes and kernel times above the page's notes marker, which it rewrites; the notes below it
are kept.
"""

from __future__ import annotations

from pathlib import Path

NOTES_MARKER = "<!-- Notes below this line are kept when the report is rewritten. -->"
TITLE = "# Does the Hadamard rotation earn its cost? TLq against TLq-HS on real gradients"
LABELS = {"bytes": "bytes", "bpe": "BPE"}
CREST = ("node_crest", "node_crest_rotated")
# docs/hadamard.md's line: the rotation buys a less noisy gradient where it lowers the averaged
# gradient's total noise (sampling and quantization) by at least this much; a 1% lower noise is
# what a 2% larger batch buys, below what the accuracy study's seeds resolve.
NOISE_LINE = 0.01


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def noise_change(row: dict) -> float:
    """How much TLq-HS changes the total noise of the averaged gradient against TLq, both relative
    to the mean: sqrt(n^2 + e_hs^2) / sqrt(n^2 + e_tlq^2) - 1, n the batch's sampling noise (the
    rounding is unbiased, so its error adds to that noise in quadrature)."""
    n, both = row["batch_noise"], row["two_level_error"]
    return ((n**2 + both["tlq_hs"] ** 2) / (n**2 + both["tlq"] ** 2)) ** 0.5 - 1


def _errors(captures: list[dict], adam: bool = False) -> list[str]:
    """The errors table: as measured, or (adam) as Adam sees them, for the captures that have them."""
    lines = [
        "| vocabulary | step | train loss | group | share of the gradient | batch noise | int4 stage "
        "| int4 stage, rotated | rotated / plain | TLq | TLq-HS | TLq-HS / TLq | total noise, TLq-HS vs TLq |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for capture in captures:
        for group, measured in capture["groups"].items():
            row = measured.get("adam") if adam else measured
            if row is None:
                continue
            int4, both = row["int4_error"], row["two_level_error"]
            lines.append(
                f"| {LABELS[capture['vocab']]} | {capture['step']} | {capture['loss']:.3f} | {group} | "
                f"{_pct(measured['grad_share'])} | {_pct(row['batch_noise'])} | {_pct(int4['plain'])} | "
                f"{_pct(int4['hadamard'])} | {int4['hadamard'] / int4['plain']:.3f} | {_pct(both['tlq'])} | "
                f"{_pct(both['tlq_hs'])} | {both['tlq_hs'] / both['tlq']:.3f} | {100 * noise_change(row):+.2f}% |"
            )
    return lines


def _shapes(captures: list[dict]) -> list[str]:
    lines = [
        "| vocabulary | step | group | rank gradients: max/RMS p50, p99, max | rotated p99, max "
        "| kurtosis p50, p99 | rotated p99 | node sums: max/RMS p99 | rotated p99 | kurtosis p99 | rotated p99 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for capture in captures:
        for group, row in capture["groups"].items():
            s = row["shape"]
            lines.append(
                f"| {LABELS[capture['vocab']]} | {capture['step']} | {group} | "
                f"{s['rank_crest']['p50']:.2f}, {s['rank_crest']['p99']:.2f}, {s['rank_crest']['max']:.1f} | "
                f"{s['rank_crest_rotated']['p99']:.2f}, {s['rank_crest_rotated']['max']:.1f} | "
                f"{s['rank_kurtosis']['p50']:.2f}, {s['rank_kurtosis']['p99']:.1f} | "
                f"{s['rank_kurtosis_rotated']['p99']:.1f} | {s['node_crest']['p99']:.2f} | "
                f"{s['node_crest_rotated']['p99']:.2f} | {s['node_kurtosis']['p99']:.1f} | "
                f"{s['node_kurtosis_rotated']['p99']:.1f} |"
            )
    return lines


def _costs(report: dict) -> list[str]:
    """The kernels' table and, per vocabulary, the rotation's cost a step beside a rank's pass."""
    kernels = report.get("kernels")
    if not kernels:
        return ["Kernel times: **pending the H200 run** (the diagnostic times them on a GPU only)."]
    lines = [
        f"Kernel times on {kernels['device']} (median ms of one call, L2 emptied before each):",
        "",
        "| vocabulary | bucket | elements | grad_encode | rotated | grad_decode_sum | rotated |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in kernels["rows"]:
        enc, dec = row["encode_ms"], row["decode_ms"]
        lines.append(
            f"| {LABELS[row['vocab']]} | {row['bucket']} | {row['numel']:,} | {enc['0']:.3f} | {enc['32']:.3f} | "
            f"{dec['0']:.3f} | {dec['32']:.3f} |"
        )
    lines.append("")
    passes = {c["vocab"]: c["rank_pass_ms"] for c in report["captures"]}  # the last capture's
    for vocab, step in kernels["per_step_ms"].items():
        plain = step["encode_0"] + step["decode_0"]
        extra = step["encode_32"] + step["decode_32"] - plain
        share = f", {_pct(extra / passes[vocab])} of a rank's forward and backward ({passes[vocab]:.1f} ms)"
        lines.append(
            f"- {LABELS[vocab]}: the rotation adds **{1e3 * extra:.0f} us a step** to a rank's encode and decode "
            f"({1e3 * plain:.0f} us without it){share if vocab in passes else ''}."
        )
    return lines


def _summary(report: dict) -> list[str]:
    """Per vocabulary, at its last measured step: what the rotation does, and the rule's verdict."""
    last = {c["vocab"]: c for c in report["captures"]}
    lines = []
    for vocab, capture in last.items():
        groups, row = capture["groups"], capture["groups"]["all"]
        ratios = {
            group: (
                groups[group]["int4_error"]["hadamard"] / groups[group]["int4_error"]["plain"],
                groups[group]["two_level_error"]["tlq_hs"] / groups[group]["two_level_error"]["tlq"],
            )
            for group in ("all", "embedding")
        }
        change = noise_change(row)
        verdict = (
            "past the 1% line: the rotation buys a less noisy gradient"
            if change <= -NOISE_LINE
            else "below the 1% line: the rotation does not buy a less noisy gradient"
        )
        lines.append(
            f"- {LABELS[vocab]}, step {capture['step']}: the rotation scales the int4 stage's error by "
            f"{ratios['all'][0]:.3f} (embedding {ratios['embedding'][0]:.3f}) and the two-level error by "
            f"{ratios['all'][1]:.3f} (embedding {ratios['embedding'][1]:.3f}); TLq's error is "
            f"{row['two_level_error']['tlq'] / row['batch_noise']:.2f}x the batch's sampling noise, and TLq-HS "
            f"changes the total gradient noise by {100 * change:+.2f}%: **{verdict}** (see below)."
        )
        weighted = [c for c in report["captures"] if c["vocab"] == vocab and "adam" in c["groups"]["all"]]
        if weighted:
            adam = weighted[-1]["groups"]["all"]["adam"]
            both = adam["two_level_error"]
            lines.append(
                f"  As Adam sees them (step {weighted[-1]['step']}): the rotation scales the two-level error by "
                f"{both['tlq_hs'] / both['tlq']:.3f} ({_pct(both['tlq'])} to {_pct(both['tlq_hs'])}), against a "
                f"sampling noise of {_pct(adam['batch_noise'])}, and changes the total gradient noise by "
                f"{100 * noise_change(adam):+.2f}%."
            )
    return lines


def merge(reports: list[dict]) -> dict:
    """One report from the outputs of several calls (e.g. the last steps on a fresh machine): the
    captures of all, one per vocabulary and step, the first kernel times found. They must share
    the corpus and the tokenizer, or their numbers do not belong in one table."""
    first = reports[0]
    for other in reports[1:]:
        for vocab, key in (("bytes", "content_sha256"), ("bpe", "tokenizer_sha256")):
            if other["corpus"][vocab][key] != first["corpus"][vocab][key]:
                raise SystemExit(f"the outputs differ in {vocab} {key}: one report cannot hold both")
    captures = {(c["step"], c["vocab"]): c for report in reversed(reports) for c in report["captures"]}
    return {
        **first,
        "steps": sorted({c["step"] for c in captures.values()}),
        "captures": [captures[key] for key in sorted(captures, key=lambda k: (k[0], k[1] != "bytes"))],
        "kernels": next((r["kernels"] for r in reports if r.get("kernels")), None),
    }


def write_report(report: dict, docs: Path) -> None:
    """Rewrite docs/hadamard.md above its notes marker and draw docs/hadamard.png."""
    captures = report["captures"]
    if not captures:
        raise SystemExit("the diagnostic's output holds no measurement yet")
    bpe = report["corpus"]["bpe"]
    study = report["study"]["bytes"]
    header = [
        TITLE,
        "",
        f"Generated by `python benchmarks/hadamard_diagnostic.py --report` from the run on {report['device']} "
        f"(torch {report['torch']}): the GPU accuracy study's {study['n_layer']} x {study['n_embd']} GPT "
        f"({study['block_size']} tokens of context) trained as the baseline, and at steps "
        f"{', '.join(map(str, report['steps']))} of its {report['study_steps']:,} "
        f"every rank's gradient of a {study['world']} job (nodes x ranks per node) measured with the reference "
        "ops under the tlq and tlq_hs presets (int8 inside a node, int4 across, groups of 128, stochastic "
        "rounding; rotation: 32-point Hadamard). Errors are relative: ||error|| / ||reference||.",
        "",
        f"- byte vocabulary: 256 symbols; corpus content SHA-256 `{bpe['content_sha256']}`",
        f"- BPE vocabulary: {bpe['tokenizer_vocab']:,} tokens, tokenizer JSON SHA-256 `{bpe['tokenizer_sha256']}`, "
        f"trained on {bpe['tokenizer_trained_on']} (tokenizers {bpe['tokenizers_version']}); "
        f"{bpe['bytes_per_token']} bytes a token",
        "",
        *_summary(report),
        "",
        "## Errors per parameter group",
        "",
        "The int4 stage alone (each node's exact sum of its ranks' gradients, quantized and dequantized "
        "without and with the rotation) and the two-level path end to end (TLq, TLq-HS) against the exact "
        "mean. Share: the group's part of the squared norm of the mean gradient. Batch noise: the standard "
        "error of the mean over the ranks' windows (the batch's sampling noise). Total noise: what TLq-HS "
        "changes, against TLq, in the averaged gradient's noise, sampling and quantization together.",
        "",
        *_errors(captures),
        "",
        "## Errors as Adam sees them",
        "",
        "The same errors with every element weighted by Adam's preconditioner 1 / (sqrt(v) + eps), v the "
        "baseline optimizer's second moment before the step (bias-corrected): the relative size of the error "
        "in the update Adam takes, where every element moves by about the learning rate whatever its "
        "gradient's size. Captures at step 0 (no optimizer state yet) and from runs before this measure "
        "existed have no rows here.",
        "",
        *_errors(captures, adam=True),
        "",
        "## The shape of the quantization groups",
        "",
        "Per group of 128 elements (the quantizer's absmax sets its scale): max/RMS, and kurtosis "
        "E[x^4]/E[x^2]^2 (3 for Gaussian values, 128 for a lone spike), of every rank's gradient (the int8 "
        "stage's input) and of the node sums (the int4 stage's input), plain and rotated.",
        "",
        *_shapes(captures),
        "",
        "## What the rotation costs",
        "",
        *_costs(report),
        "",
        "![the rotation's effect per parameter group](hadamard.png)",
        "",
        NOTES_MARKER,
    ]
    page = docs / "hadamard.md"
    kept = page.read_text().split(NOTES_MARKER, 1) if page.exists() else []
    page.write_text("\n".join(header) + (kept[1] if len(kept) == 2 else "\n"))
    _plot(captures, docs / "hadamard.png")


def _plot(captures: list[dict], path: Path) -> None:
    """Three panels at each vocabulary's last step, per parameter group (bytes, BPE; plain hollow,
    rotated filled): the int4 stage's error, the two-level error, the node sums' p99 max/RMS. A
    fourth: TLq-HS / TLq end to end against the step, all groups and the embedding."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    last = {c["vocab"]: c for c in captures}
    groups = list(next(iter(last.values()))["groups"])
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    panels = [  # (title, group -> (plain, rotated))
        ("int4 stage alone: relative error", lambda g: (g["int4_error"]["plain"], g["int4_error"]["hadamard"])),
        ("two-level, end to end: relative error", lambda g: tuple(g["two_level_error"][k] for k in ("tlq", "tlq_hs"))),
        ("node sums: p99 of max/RMS per group", lambda g: tuple(g["shape"][k]["p99"] for k in CREST)),
    ]
    width = 0.2
    for axis, (title, pick) in zip(axes, panels, strict=False):
        for index, (vocab, capture) in enumerate(last.items()):
            values = [pick(capture["groups"][g]) for g in groups]
            colour = f"C{index}"
            for offset, (label, fill) in enumerate((("plain", "none"), ("rotated", colour))):
                x = [i + (2 * index + offset - 1.5) * width for i in range(len(groups))]
                axis.bar(x, [v[offset] for v in values], width, edgecolor=colour, color=fill,
                         label=f"{LABELS[vocab]} step {capture['step']}, {label}")  # fmt: skip
        axis.set_xticks(range(len(groups)), groups, rotation=30)
        axis.set_title(title, fontsize=10)
    for axis in axes[:2]:
        axis.set_yscale("log")  # the norms' errors sit far above the rest (small gradients in shared groups)
    axes[0].legend(fontsize=7)
    for index, vocab in enumerate(last):
        for group, style in (("all", "-"), ("embedding", "--")):
            points = [(c["step"], c["groups"][group]["two_level_error"]) for c in captures if c["vocab"] == vocab]
            axes[3].plot([s for s, _ in points], [e["tlq_hs"] / e["tlq"] for _, e in points], style, marker="o",
                         color=f"C{index}", label=f"{LABELS[vocab]}, {group}")  # fmt: skip
    axes[3].axhline(1.0, color="black", linewidth=0.5)
    axes[3].set_title("TLq-HS error / TLq error (below 1: the rotation helps)", fontsize=10)
    axes[3].set_xlabel("step")
    axes[3].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
