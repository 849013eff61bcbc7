"""SDP4Bit's Table 1 at the GPT-125M shape, on real text, on one GPU: every run is a job of
16 nodes x 4 ranks simulated on one device (`lightning_sdp4bit.simulation`).

    python benchmarks/accuracy_gpu.py --runs all --budget 540     # train what is pending for ~9 min, resumable
    python benchmarks/accuracy_gpu.py --throughput                # simulated W=64 vs a plain single-GPU step
    python benchmarks/accuracy_gpu.py --report                    # docs/accuracy_gpu.md and .png from finished runs
    python benchmarks/accuracy_gpu.py --smoke --results /tmp/s    # CI: a tiny model for a few steps, on CPU
    python benchmarks/accuracy_gpu.py --tokenizer bpe --runs baseline-d0,tlq-r0,tlq_hs-r0 --budget 540

Each run trains the same 12 x 768 GPT (12 heads, 1024 tokens of context, byte tokens) from the
same initial weights on the same data in the same order, for the same number of tokens, with
AdamW (0.9, 0.95), weight decay 0.1, a cosine schedule and clipping at 1.0 (the paper's recipe),
and nothing tuned per preset. The corpus is the source and documentation files of the installed
Python packages (benchmarks/corpus.py), validation their held-out files. Rank r of the simulated
job reads what DistributedSampler(num_replicas=64, rank=r) over one shuffled list of windows gives
it. A run checkpoints into --state (the device machine's disk) when its budget ends and resumes
from there; a finished run writes <results>/<run>.json, which the study then skips.

`--tokenizer bpe` runs the same study on a byte-level BPE vocabulary of 49,984 tokens
(benchmarks/bpe.py: trained on the training files, or `--tokenizer-file`; its SHA-256 goes into
every result) instead of bytes: the model becomes GPT-2's 124M shape, the losses are nats per
token, and its results, states and report are its own (results/accuracy_gpu_bpe,
docs/accuracy_gpu_bpe.md). Its budget is the byte study's share of the corpus (150M of 398M
training bytes: 37.7%), so both read the same text once: about 40M BPE tokens, 615 steps of the
same batch. (The byte study's 150M tokens would be 1.4 passes over the corpus in BPE tokens.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "benchmarks")]

from bpe import BPE_VOCAB, bpe_corpus  # noqa: E402
from corpus import build_corpus  # noqa: E402
from gpt.model import GPT, GPTConfig  # noqa: E402
from gpt.module import decay_groups, warmup_cosine  # noqa: E402

from lightning_sdp4bit import SDP4BitConfig  # noqa: E402
from lightning_sdp4bit.simulation import SimulatedEngine, parse_world  # noqa: E402
from lightning_sdp4bit.simulation.graphed import GraphedRanks  # noqa: E402

PRESETS = ["baseline", "qw", "qwd", "ulq", "tlq", "tlq_hs", "sdp4bit"]
RESULTS = ROOT / "benchmarks" / "results" / "accuracy_gpu"
RESULTS_BPE = ROOT / "benchmarks" / "results" / "accuracy_gpu_bpe"
SMOKE_BPE_VOCAB = 384  # the alphabet, the end-of-text token and 127 merges: a tokenizer trained in a second


@dataclass(frozen=True)
class Study:
    """Every setting every run shares (the model, data, schedule and budget)."""

    n_layer: int = 12
    n_embd: int = 768
    n_head: int = 12
    block_size: int = 1024
    vocab_size: int = 256  # bytes; a BPE run takes its tokenizer's
    world: str = "16x4"
    batch_per_rank: int = 1  # sequences; the global batch is 64 x 1 = 64 sequences
    tokens: int = 150_000_000
    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup_fraction: float = 0.02
    weight_decay: float = 0.1
    clip: float = 1.0
    model_seed: int = 1234
    eval_every: int = 100  # optimizer steps
    eval_windows: int = 256  # validation sequences per evaluation during training
    final_eval_windows: int = 2048  # ... at the end (2M tokens)
    corpus_limit_bytes: int | None = None
    # Two buckets for the whole model (1M, then the rest): fewer, larger simulated exchanges cost
    # the host fewer launches; the loss does not depend on it. The same for every preset.
    bucket_numel: int | None = 100_000_000

    @property
    def ranks(self) -> int:
        nodes, local = parse_world(self.world)
        return nodes * local

    @property
    def steps(self) -> int:
        return math.ceil(self.tokens / (self.ranks * self.batch_per_rank * self.block_size))


SMOKE = Study(
    n_layer=2, n_embd=32, n_head=2, block_size=64, world="2x2", tokens=24 * 4 * 64, eval_every=6,
    eval_windows=8, final_eval_windows=16, corpus_limit_bytes=2_000_000,
)  # fmt: skip


def bpe_study(study: Study, manifest: dict) -> Study:
    """The study on a BPE corpus (`manifest`: `bpe.bpe_corpus`'s): its tokenizer's vocabulary, and
    the byte study's budget as the same share of the training text (150M x 106.9M BPE tokens /
    397.8M bytes = 40.3M tokens on the H200 machine), so every run reads the same text once."""
    tokens = round(study.tokens * manifest["train_tokens"] / manifest["train_bytes"])
    return replace(study, vocab_size=manifest["tokenizer_vocab"], tokens=tokens)


def run_names(presets: list[str], seeds: int) -> list[str]:
    """baseline-d0 and baseline-d1 (the noise floor: another data order), every other preset once
    per rounding seed: qwd-r0, qwd-r1, ..."""
    names = []
    for preset in presets:
        if preset == "baseline":
            names += ["baseline-d0", "baseline-d1"]
        else:
            names += [f"{preset}-r{seed}" for seed in range(seeds)]
    return names


def parse_run(name: str) -> tuple[str, int, int]:
    """'tlq_hs-r1' -> (preset, rounding seed, data seed)."""
    preset, _, tag = name.rpartition("-")
    if preset not in PRESETS or tag[:1] not in ("r", "d") or not tag[1:].isdigit():
        raise ValueError(f"run {name!r}: expected <preset>-r<rounding seed> or baseline-d<data seed>")
    return preset, int(tag[1:]) if tag[0] == "r" else 0, int(tag[1:]) if tag[0] == "d" else 0


class Data:
    """Windows of block_size + 1 tokens; the order is one permutation per data seed and pass over
    the corpus (a study that needs more windows than the corpus holds takes further passes, each
    in a new order drawn from the same generator: the first pass's order does not change)."""

    def __init__(self, corpus, study: Study, data_seed: int, device: torch.device):
        self.study, self.device = study, device
        span = study.block_size + 1
        self.train = corpus.train.to(device)
        self.val = corpus.val.to(device)
        count = (self.train.numel() - 1) // study.block_size
        needed = study.steps * study.ranks * study.batch_per_rank
        self.epochs = -(-needed // count)
        generator = torch.Generator().manual_seed(data_seed)
        self.order = torch.cat([torch.randperm(count, generator=generator) for _ in range(self.epochs)]).to(device)
        self.val_count = (self.val.numel() - 1) // study.block_size
        self._span = span

    def _windows(self, starts: torch.Tensor, source: torch.Tensor | None = None) -> torch.Tensor:
        index = starts[:, None] * self.study.block_size + torch.arange(self._span, device=self.device)
        return (self.train if source is None else source)[index].long()

    def batches(self, step: int) -> torch.Tensor:
        """Windows [W, b, T + 1]: row r is what DistributedSampler(num_replicas=W, rank=r) over
        `order` puts in rank r's batch `step`, positions r + W * (step * b + k) for k < b."""
        w, b = self.study.ranks, self.study.batch_per_rank
        positions = torch.arange(w, device=self.device)[:, None] + w * (step * b + torch.arange(b, device=self.device))
        return self._windows(self.order[positions.flatten()]).view(w, b, self._span)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, windows: int, chunk: int = 16) -> float:
        """Mean cross-entropy (nats per token) over the first `windows` held-out windows."""
        windows = min(windows, self.val_count)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for start in range(0, windows, chunk):
            tokens = self._windows(torch.arange(start, min(windows, start + chunk), device=self.device), self.val)
            total += loss_of(model, tokens, reduction="sum").double()
        return (total / (windows * self.study.block_size)).item()


def loss_of(model: torch.nn.Module, tokens: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy of windows [b, T + 1], in fp32."""
    logits = model(tokens[:, :-1]).float()
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction=reduction)


class RankPasses:
    """Every simulated rank's forward and backward into its window gradients, in rank order:
    replayed from CUDA graphs on a GPU (the eager pass's bits without its host launches, `streams`
    ranks at a time), eager on a CPU."""

    def __init__(
        self, model: torch.nn.Module, engine: SimulatedEngine, example: torch.Tensor, graphed: bool, streams: int = 2
    ):
        self.model, self.engine = model, engine
        params = [p for bucket in engine.buckets for p in bucket.params]
        self.graphs = GraphedRanks(lambda t: loss_of(model, t), example, params, streams) if graphed else None

    def step(self, micro_batches: torch.Tensor, total: torch.Tensor) -> None:
        """Rank r trains on micro_batches[r] ([W, b, T + 1]); its loss is added to `total`, in rank
        order. Each rank's backward runs in its turn of the engine's step protocol."""
        engine = self.engine
        if self.graphs is None:
            for rank, tokens in enumerate(micro_batches):
                with engine.running_as(rank):
                    engine.pre_backward()
                    loss = loss_of(self.model, tokens)
                    loss.backward()
                    engine.receive_grads()
                total += loss.detach()
            return

        def take(rank: int, loss: torch.Tensor, grads: list) -> None:
            with engine.running_as(rank):
                engine.pre_backward()
                engine.receive_grads(grads)
            total.add_(loss)

        self.graphs.run(micro_batches, take)


def build(study: Study, preset: str, rounding_seed: int, device: torch.device):
    torch.manual_seed(study.model_seed)
    config = GPTConfig(study.vocab_size, study.block_size, study.n_layer, study.n_head, study.n_embd)
    model = GPT(config).to(device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    nodes, local = parse_world(study.world)
    config = SDP4BitConfig.preset(preset, seed=rounding_seed, bucket_numel=study.bucket_numel)
    engine = SimulatedEngine(model, config, nodes, local)
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(decay_groups(model, study.weight_decay), lr=study.lr, betas=(0.9, 0.95), **fused)
    engine.shard_optimizer(optimizer)
    warmup = max(1, round(study.warmup_fraction * study.steps))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, warmup, study.steps, study.min_lr / study.lr)
    )
    return model, engine, optimizer, schedule


def state_of(model, engine, schedule, progress) -> dict:
    return {
        "model": model.state_dict(),
        "masters": [[b.master for b in rank.buckets] for rank in engine.ranks],
        "optimizers": [rank.optimizers[0].state_dict() for rank in engine.ranks],
        "schedule": schedule.state_dict(),
        "engine_step": engine.step,
        "progress": progress,
    }


def restore(state, model, engine, schedule) -> dict:
    model.load_state_dict(state["model"])
    engine.weights_loaded()  # written from outside: no write of a hook's for the masters to take in
    for rank, masters in zip(engine.ranks, state["masters"], strict=True):
        for bucket, master in zip(rank.buckets, masters, strict=True):
            bucket.master.copy_(master)
    for rank, optimizer_state in zip(engine.ranks, state["optimizers"], strict=True):
        rank.optimizers[0].load_state_dict(optimizer_state)
    schedule.load_state_dict(state["schedule"])
    engine.restore_step(state["engine_step"])
    return state["progress"]


def train_run(
    name: str, study: Study, corpus, device: torch.device, state_dir: Path, deadline: float, streams: int = 2
) -> dict | None:
    """Train `name` until done (returns its results) or until `deadline` (saves, returns None).
    `streams`: ranks whose graphs replay at once on a GPU (the same bits for any value)."""
    preset, rounding_seed, data_seed = parse_run(name)
    data = Data(corpus, study, data_seed, device)
    model, engine, optimizer, schedule = build(study, preset, rounding_seed, device)
    state_path = state_dir / (f"{name}.pt" if study.vocab_size == 256 else f"{name}-v{study.vocab_size}.pt")
    progress = {"step": 0, "seconds": 0.0, "val": [], "train": [], "train_partial": 0.0}
    if state_path.exists():
        progress = restore(torch.load(state_path, map_location=device, weights_only=False), model, engine, schedule)
        print(f"{name}: resumed at step {progress['step']}", flush=True)
    started, stats = time.time(), {}
    passes = RankPasses(model, engine, data.batches(0)[0], graphed=device.type == "cuda", streams=streams)
    train_sum = torch.full((), progress["train_partial"], device=device)  # losses since the last report
    for step in range(progress["step"], study.steps):
        if step % study.eval_every == 0:
            progress["val"].append((step, data.evaluate(model, study.eval_windows)))
        passes.step(data.batches(step), train_sum)
        stats = engine.optimizer_step(study.clip)
        schedule.step()
        progress["step"] = step + 1
        if progress["step"] % study.eval_every == 0:
            progress["train"].append((progress["step"], train_sum.item() / (study.eval_every * study.ranks)))
            train_sum.zero_()
            print(f"{name}: step {progress['step']}/{study.steps} train {progress['train'][-1][1]:.4f} "
                  f"val {progress['val'][-1][1]:.4f}", flush=True)  # fmt: skip
        if time.time() > deadline and progress["step"] < study.steps:
            progress["seconds"] += time.time() - started
            progress["train_partial"] = train_sum.item()
            state_dir.mkdir(parents=True, exist_ok=True)
            torch.save(state_of(model, engine, schedule, progress), state_path.with_suffix(".tmp"))
            os.replace(state_path.with_suffix(".tmp"), state_path)
            print(f"{name}: out of budget at step {progress['step']}, state saved to {state_path}", flush=True)
            return None
    progress["seconds"] += time.time() - started
    final = data.evaluate(model, study.final_eval_windows)
    progress["val"].append((study.steps, data.evaluate(model, study.eval_windows)))
    return {
        "run": name,
        "preset": preset,
        "rounding_seed": rounding_seed,
        "data_seed": data_seed,
        "final_val_loss": final,
        "final_val_tokens": min(study.final_eval_windows, data.val_count) * study.block_size,
        "val_curve": progress["val"],
        "train_curve": progress["train"],
        "steps": study.steps,
        "tokens": study.steps * study.ranks * study.batch_per_rank * study.block_size,
        "data_epochs": data.epochs,
        "train_seconds": progress["seconds"],
        "bits_per_element": {k: v for k, v in stats.items() if k.endswith("_bits_per_element")},
        "study": asdict(study),
        "corpus": corpus.manifest,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="all", help="comma-separated run names, or 'all'")
    parser.add_argument("--seeds", type=int, default=2, help="rounding seeds per stochastic preset")
    parser.add_argument("--budget", type=float, default=540, help="seconds of training in this call")
    parser.add_argument("--results", type=Path, help="default: benchmarks/results/accuracy_gpu(_bpe)")
    parser.add_argument("--state", type=Path, help="default: /tmp/sdp4bit_accuracy_gpu(_bpe)")
    parser.add_argument("--tokenizer", choices=["bytes", "bpe"], default="bytes", help="the vocabulary")
    parser.add_argument(
        "--tokenizer-file", type=Path, help="with --tokenizer bpe: this tokenizer JSON, not one trained"
    )
    parser.add_argument("--streams", type=int, default=2, help="GPU: ranks replayed at once (same bits for any)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model for a few steps (CI, CPU)")
    parser.add_argument("--throughput", action="store_true", help="measure the simulation's speed and memory")
    parser.add_argument("--report", action="store_true", help="write docs/accuracy_gpu(_bpe).md from finished runs")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs", help="where --report writes")
    args = parser.parse_args(argv)
    if args.streams < 1:
        parser.error(f"--streams must be at least 1, got {args.streams}")
    if args.seeds < 1:
        parser.error(f"--seeds must be at least 1, got {args.seeds}")
    if args.budget < 0:
        parser.error(f"--budget must be at least 0 seconds, got {args.budget:g}")
    study_runs = run_names(PRESETS, args.seeds)
    names = study_runs if args.runs == "all" else args.runs.split(",")
    unknown = [name for name in names if name not in study_runs]
    if unknown:  # every name checked before anything trains
        parser.error(
            f"--runs: {', '.join(map(repr, unknown))} not in the study; with --seeds {args.seeds} its runs are "
            + ", ".join(study_runs)
        )
    if args.tokenizer_file is not None and (args.tokenizer != "bpe" or not args.tokenizer_file.is_file()):
        parser.error(f"--tokenizer-file {args.tokenizer_file}: needs --tokenizer bpe and an existing file")
    bpe = args.tokenizer == "bpe"
    args.results = args.results or (RESULTS_BPE if bpe else RESULTS)
    args.state = args.state or Path("/tmp/sdp4bit_accuracy_gpu" + ("_bpe" if bpe else ""))
    study = SMOKE if args.smoke else Study()
    if args.report:
        from accuracy_gpu_report import write_report

        write_report(args.results, args.docs, "accuracy_gpu_bpe" if bpe else "accuracy_gpu")
        return
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    vocab = SMOKE_BPE_VOCAB if args.smoke else BPE_VOCAB
    if args.throughput:
        from accuracy_gpu_report import measure_throughput

        measure_throughput(replace(study, vocab_size=vocab) if bpe else study, device, args.results)
        return
    pending = [n for n in names if not (args.results / f"{n}.json").exists()]
    print(f"finished: {len(names) - len(pending)} of {len(names)}; pending: {pending}", flush=True)
    if not pending:
        return
    corpus = build_corpus(limit_bytes=study.corpus_limit_bytes)
    if bpe:
        corpus = bpe_corpus(corpus, vocab, args.state, args.tokenizer_file)
        study = bpe_study(study, corpus.manifest)
    print(f"corpus: {json.dumps(corpus.manifest)}", flush=True)
    deadline = time.time() + args.budget  # training time: the corpus is read first
    for index, name in enumerate(pending):
        if index and time.time() > deadline:  # the first pending run always gets a step
            break
        result = train_run(name, replace(study), corpus, device, args.state, deadline, args.streams)
        if result is not None:
            args.results.mkdir(parents=True, exist_ok=True)
            (args.results / f"{name}.json").write_text(json.dumps(result, indent=1))
            print(f"{name}: final validation loss {result['final_val_loss']:.5f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
