"""Does the Hadamard smoothing earn its cost? TLq against TLq-HS on real gradients, with the byte
vocabulary and with a BPE one, at a few points of a baseline run (docs/hadamard.md).

    python benchmarks/hadamard_diagnostic.py --out OUT                # the H200: about 6 min, resumable
    python benchmarks/hadamard_diagnostic.py --smoke --out /tmp/d     # CI: a tiny model, a few steps, on CPU
    python benchmarks/hadamard_diagnostic.py --report OUT/hadamard_diagnostic.json   # docs/hadamard.md, .png
    python benchmarks/hadamard_diagnostic.py --report A.json B.json    # the captures of two calls together

For each vocabulary (bytes: 256 symbols; bpe: 49,984 tokens, benchmarks/bpe.py, trained on the
training files only) it trains the GPU accuracy study's model (benchmarks/accuracy_gpu.py: 12 x
768, 1024 tokens of context) from the study's initial weights on its data order and schedule, one
plain step of the whole global batch (64 x 1 x 1024 tokens) at a time: bf16 weights, fp32 master
weights, fused AdamW, clipping at 1.0: the baseline preset's math up to rounding (the bf16 gradients
of 4 micro-batches of 16 windows summed in fp32, where the engine sums 64 ranks' ones). At
each of --steps, before that step's update, it takes every simulated rank's own gradient (16
nodes x 4: rank r's window is the one DistributedSampler gives rank r), lays them out in the
engine's buckets and measures them (benchmarks/hadamard_errors.py). On a GPU it also times the
grad_encode and grad_decode_sum kernels with and without the rotation at each bucket's size: the
rotation's cost per step, beside a rank's forward and backward of its window (timed in the same run).

Resumable: --state keeps the tokenizer, the encoded corpus, each finished measurement and, at the
end of a call (its last steps or --budget, seconds from the start, reached), each run's training
state; a later call with the same --state goes on from there and skips what is done. Every call
writes all that is finished to --out: hadamard_diagnostic.json and the BPE tokenizer, bpe_tokenizer.json.
The state lives on the machine; on a fresh one, a call with the missing --steps alone and a report
of both outputs (the same corpus and tokenizer, which the report checks) give the same page.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "benchmarks")]

from accuracy_gpu import SMOKE, SMOKE_BPE_VOCAB, Data, Study, loss_of  # noqa: E402
from bpe import BPE_VOCAB, bpe_corpus  # noqa: E402
from corpus import build_corpus  # noqa: E402
from gpt.model import GPT, GPTConfig  # noqa: E402
from gpt.module import decay_groups, warmup_cosine  # noqa: E402
from hadamard_errors import ROTATION, TLQ_HS, Tally, element_labels, measure_bucket  # noqa: E402

from lightning_sdp4bit.buffers import bucket_layouts  # noqa: E402
from lightning_sdp4bit.simulation import parse_world  # noqa: E402

VOCABS = ["bytes", "bpe"]
# The GPT's parameters (examples/gpt/model.py) by what they do. The token embedding is also the
# output head (tied, as GPT-2 and Megatron tie them): one gradient, both roles.
GROUPS = ["embedding", "positions", "attention", "mlp", "norms"]
MICRO = 16  # sequences per forward of the global batch: bounds the BPE logits' memory (fp32 [16, 1024, V])
DEFAULT_STEPS = "100,300,500"  # of the study's 2,289: what fits in about 6 minutes on one H200


def group_of(name: str) -> int:
    """Index in GROUPS of a GPT parameter's name."""
    if name in ("wte.weight", "wpe.weight"):
        return 0 if name == "wte.weight" else 1
    for index, marker in ((2, ".attn."), (3, ".mlp."), (4, "ln_")):
        if marker in name:
            return index
    raise ValueError(f"parameter {name!r} is in none of {GROUPS}")


class Baseline:
    """A baseline run of the study's model, data order and schedule, a plain step at a time."""

    def __init__(self, study: Study, corpus, device: torch.device):
        self.study, self.device, self.step = study, device, 0
        self.data = Data(corpus, study, 0, device)
        torch.manual_seed(study.model_seed)  # the initial weights of accuracy_gpu.build
        config = GPTConfig(study.vocab_size, study.block_size, study.n_layer, study.n_head, study.n_embd)
        self.model = GPT(config).to(device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
        self.masters = {id(p): p.detach().float().clone().requires_grad_() for p in self.model.parameters()}
        groups = [
            {**group, "params": [self.masters[id(p)] for p in group["params"]]}
            for group in decay_groups(self.model, study.weight_decay)
        ]
        fused = {"fused": True} if device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW(groups, lr=study.lr, betas=(0.9, 0.95), **fused)
        warmup = max(1, round(study.warmup_fraction * study.steps))
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: warmup_cosine(s, warmup, study.steps, study.min_lr / study.lr)
        )

    def train_step(self) -> None:
        windows = self.data.batches(self.step).flatten(0, 1)  # [W * b, T + 1]
        pairs = [(p, self.masters[id(p)]) for p in self.model.parameters()]
        for chunk in windows.split(MICRO):
            (loss_of(self.model, chunk) * (chunk.shape[0] / windows.shape[0])).backward()
            for param, master in pairs:  # summed in fp32, as the engine sums its ranks
                master.grad = param.grad.float() if master.grad is None else master.grad.add_(param.grad)
                param.grad = None
        torch.nn.utils.clip_grad_norm_([m for _, m in pairs], self.study.clip)
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for param, master in pairs:
                param.copy_(master)
        self.step += 1

    def state(self) -> dict:
        masters = [self.masters[id(p)] for p in self.model.parameters()]
        return {"step": self.step, "model": self.model.state_dict(), "masters": masters,
                "optimizer": self.optimizer.state_dict(), "schedule": self.schedule.state_dict()}  # fmt: skip

    def load(self, state: dict) -> None:
        self.step = state["step"]
        self.model.load_state_dict(state["model"])
        with torch.no_grad():
            for param, master in zip(self.model.parameters(), state["masters"], strict=True):
                self.masters[id(param)].copy_(master)
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])


@contextlib.contextmanager
def _stopwatch(device: torch.device, into: list[float]):
    """Append the block's milliseconds to `into`: CUDA events on a GPU, the host clock on a CPU."""
    if device.type != "cuda":
        start = time.perf_counter()
        yield
        into.append(1e3 * (time.perf_counter() - start))
        return
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    yield
    end.record()
    end.synchronize()
    into.append(begin.elapsed_time(end))


def rank_gradients(run: Baseline, layouts) -> tuple[list[torch.Tensor], list[float], float]:
    """Every rank's gradient of this step's window, fp32 [W, N] per bucket, each divided by W as
    the engine's encode scales it; the ranks' forward-and-backward times (ms); their mean loss."""
    windows = run.data.batches(run.step)  # [W, b, T + 1]
    world = windows.shape[0]
    params = dict(run.model.named_parameters())
    grads = [torch.zeros(world, layout.numel, device=run.device) for layout in layouts]
    times, losses = [], []
    for rank in range(world):
        with _stopwatch(run.device, times):
            loss = loss_of(run.model, windows[rank])
            loss.backward()
        losses.append(loss.item())
        for bucket, layout in zip(grads, layouts, strict=True):
            for slot in layout.slots:
                bucket[rank, slot.start : slot.start + slot.numel] = params[slot.name].grad.reshape(-1)
            bucket[rank] *= 1.0 / world  # fp32(grad) * (1 / W), as the engine's encode scales it
        run.model.zero_grad(set_to_none=True)
    return grads, times, statistics.mean(losses)


def adam_preconditioners(run: Baseline, layouts) -> list[torch.Tensor] | None:
    """Per bucket fp32 [N]: 1 / (sqrt(v / (1 - beta2^t)) + eps), what Adam divides each element's
    update by, from the optimizer's state before this step's update (0 where no parameter lies);
    None before the first step, when Adam holds no state."""
    params = dict(run.model.named_parameters())
    states = [(run.optimizer.state.get(run.masters[id(param)]), name) for name, param in params.items()]
    if any(state is None or "exp_avg_sq" not in state for state, _ in states):
        return None
    (_, beta2), eps = run.optimizer.defaults["betas"], run.optimizer.defaults["eps"]
    weights = {}
    for state, name in states:
        correction = 1 - beta2 ** float(state["step"])
        weights[name] = 1.0 / ((state["exp_avg_sq"] / correction).sqrt() + eps)
    out = [torch.zeros(layout.numel, device=run.device) for layout in layouts]
    for bucket, layout in zip(out, layouts, strict=True):
        for slot in layout.slots:
            bucket[slot.start : slot.start + slot.numel] = weights[slot.name].reshape(-1)
    return out


def capture(run: Baseline, vocab: str) -> dict:
    """This step's measurements (hadamard_errors.measure_bucket over every bucket)."""
    study = run.study
    nodes, local = parse_world(study.world)
    config = replace(TLQ_HS, bucket_numel=study.bucket_numel)  # tlq has the same buckets: no weight groups
    layouts = bucket_layouts(list(run.model.named_parameters()), config, study.ranks)
    grads, times, loss = rank_gradients(run, layouts)
    adam = adam_preconditioners(run, layouts) or [None] * len(layouts)
    tally = Tally(GROUPS)
    for index, (layout, bucket) in enumerate(zip(layouts, grads, strict=True)):
        labels = element_labels(layout, group_of, len(GROUPS), run.device)
        measure_bucket(bucket, labels, local, run.step, index, tally, adam[index])
    return {
        "vocab": vocab, "step": run.step, "loss": loss, "world": study.world, "vocab_size": study.vocab_size,
        "rank_pass_ms": statistics.median(times), "buckets": [layout.numel for layout in layouts],
        "groups": tally.summary(),
    }  # fmt: skip


def time_rotation(layouts: dict[str, list], world: str) -> dict:
    """Median ms (CUDA events, L2 emptied before each call: benchmarks/kernels.py's Timer) of the
    grad_encode and grad_decode_sum kernels with the rotation off (0) and on (32), at each bucket
    of each vocabulary's model, as one rank of the `world` job runs them (the presets' settings),
    and their sum over a step's buckets: what the rotation costs a rank a step."""
    from kernels import Timer  # benchmarks/kernels.py

    timer, rows = Timer("read"), []
    for vocab, buckets in layouts.items():
        for layout in buckets:
            rows.append({"vocab": vocab, "bucket": layout.index, "numel": layout.numel,
                         **_time_bucket(timer, layout, *parse_world(world), torch.device("cuda"))})  # fmt: skip
            print(f"kernels: {json.dumps(rows[-1])}", flush=True)
    per_step = {
        vocab: {
            f"{kind}_{size}": sum(row[f"{kind}_ms"][size] for row in rows if row["vocab"] == vocab)
            for kind in ("encode", "decode")
            for size in (0, ROTATION)
        }
        for vocab in layouts
    }
    return {"rows": rows, "per_step_ms": per_step, "device": torch.cuda.get_device_name()}


def _time_bucket(timer, layout, nodes: int, local: int, device: torch.device) -> dict:
    """{"encode_ms": {0: ms, 32: ms}, "decode_ms": {...}} of one bucket: grad_encode of its bf16
    gradients [N] (stage 1), grad_decode_sum of the M int4 chunks of its shard (stage 3).
    `timer(fn)`: fn's time in ms. (On a CPU the kernels run only in Triton's interpreter.)"""
    from lightning_sdp4bit import kernels
    from lightning_sdp4bit.reference.ops import encode_rows

    config = TLQ_HS
    grad = (1e-3 * torch.randn(layout.numel, device=device)).bfloat16()  # the module's gradients
    received = encode_rows(
        torch.randn(nodes, layout.shard_numel, device=device), config.grad_inter_bits, config.grad_group_size,
        "nearest", 0,
    )  # fmt: skip
    out = torch.empty(layout.shard_numel, device=device)
    times: dict = {"encode_ms": {}, "decode_ms": {}}
    for size in (0, ROTATION):
        times["encode_ms"][size] = timer(lambda size=size: kernels.grad_encode(
            grad, nodes, local, size, config.grad_intra_bits, config.grad_group_size, config.rounding, 1,
            1.0 / (nodes * local)))  # fmt: skip
        times["decode_ms"][size] = timer(lambda size=size: kernels.grad_decode_sum(
            received, config.grad_inter_bits, config.grad_group_size, size, out))  # fmt: skip
    return times


def publish(state: Path, out: Path, meta: dict) -> None:
    """Everything finished in `state` into out/hadamard_diagnostic.json (and the tokenizer beside it)."""
    parts = [json.loads(p.read_text()) for p in sorted(state.glob("part-*.json"))]
    kernels = state / "kernels.json"
    report = {**meta, "captures": sorted(parts, key=lambda p: (p["step"], VOCABS.index(p["vocab"]))),
              "kernels": json.loads(kernels.read_text()) if kernels.exists() else None}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "hadamard_diagnostic.json").write_text(json.dumps(report, indent=1))
    tokenizer = meta.get("corpus", {}).get("bpe", {}).get("tokenizer_file")
    if tokenizer:
        shutil.copyfile(tokenizer, out / "bpe_tokenizer.json")


def _save(path: Path, value) -> None:
    torch.save(value, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)


def diagnose(args, study: Study, steps: list[int]) -> None:
    deadline = args.started + args.budget
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.state.mkdir(parents=True, exist_ok=True)
    part = {(v, s): args.state / f"part-{v}-{s:06d}.json" for v in args.vocabs for s in steps}
    pending = [(s, v) for s in steps for v in args.vocabs if not part[v, s].exists()]
    time_kernels = device.type == "cuda" and not (args.state / "kernels.json").exists()
    print(f"pending captures: {pending}; kernel timing: {'pending' if time_kernels else 'done or no GPU'}", flush=True)
    if not pending and not time_kernels and (args.state / "meta.json").exists():
        publish(args.state, args.out, json.loads((args.state / "meta.json").read_text()))
        print(f"nothing pending; wrote {args.out}", flush=True)
        return
    byte_corpus = build_corpus(limit_bytes=study.corpus_limit_bytes)
    corpora = {"bytes": byte_corpus, "bpe": bpe_corpus(byte_corpus, args.vocab, args.state)}
    studies = {v: replace(study, vocab_size=corpora[v].manifest.get("tokenizer_vocab", 256)) for v in VOCABS}
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    meta = {
        "study": {v: asdict(s) for v, s in studies.items()}, "steps": steps, "study_steps": study.steps,
        "corpus": {v: c.manifest for v, c in corpora.items()}, "device": name, "torch": torch.__version__,
    }  # fmt: skip
    (args.state / "meta.json").write_text(json.dumps(meta, indent=1))
    print(f"prepared in {time.time() - args.started:.0f} s", flush=True)
    if time_kernels:
        layouts = {}
        for vocab, s in studies.items():
            with torch.device("meta"):  # the parameters' names and shapes, no storage
                named = list(
                    GPT(GPTConfig(s.vocab_size, s.block_size, s.n_layer, s.n_head, s.n_embd)).named_parameters()
                )
            layouts[vocab] = bucket_layouts(named, replace(TLQ_HS, bucket_numel=s.bucket_numel), s.ranks)
        (args.state / "kernels.json").write_text(json.dumps(time_rotation(layouts, study.world), indent=1))
        publish(args.state, args.out, meta)
    runs: dict[str, Baseline] = {}
    for step, vocab in pending:
        if vocab not in runs:
            runs[vocab] = Baseline(studies[vocab], corpora[vocab], device)
            saved = args.state / f"run-{vocab}.pt"
            state = torch.load(saved, map_location=device, weights_only=False) if saved.exists() else None
            if state is not None and state["step"] <= step:  # else a capture before it is pending: start over
                runs[vocab].load(state)
                print(f"{vocab}: resumed at step {runs[vocab].step}", flush=True)
        run, started = runs[vocab], time.time()
        while run.step < step and time.time() < deadline:
            run.train_step()
            if run.step % 50 == 0:
                print(f"{vocab}: step {run.step} ({time.time() - started:.0f} s)", flush=True)
        if run.step < step:
            print(f"out of budget at {vocab} step {run.step}: call again with the same --state to go on", flush=True)
            break
        measured = time.time()
        part[vocab, step].write_text(json.dumps(capture(run, vocab), indent=1))
        print(f"{vocab}: step {step} measured in {time.time() - measured:.0f} s", flush=True)
        publish(args.state, args.out, meta)
    for name, run in runs.items():  # a later call with more or later --steps goes on from here
        _save(args.state / f"run-{name}.pt", run.state())
    publish(args.state, args.out, meta)
    print(
        f"{len(pending)} pending at the start; done in {time.time() - args.started:.0f} s; wrote {args.out}", flush=True
    )


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="where hadamard_diagnostic.json is written")
    parser.add_argument("--state", type=Path, default=Path("/tmp/sdp4bit_hadamard"), help="caches and resumes")
    parser.add_argument("--steps", help=f"capture steps, comma-separated (default {DEFAULT_STEPS}; smoke 2,5)")
    parser.add_argument("--vocabs", default=",".join(VOCABS), help=f"which to measure, comma-separated: {VOCABS}")
    parser.add_argument("--budget", type=float, default=320, help="seconds from the start before training stops")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, tiny vocabulary, a few steps (CI, CPU)")
    parser.add_argument(
        "--report", type=Path, nargs="+", help="hadamard_diagnostic.json file(s): write docs/hadamard.md and .png"
    )
    parser.add_argument("--docs", type=Path, default=ROOT / "docs", help="where --report writes")
    args = parser.parse_args(argv)
    args.started = time.time()
    if args.report is not None:
        from hadamard_report import merge, write_report

        write_report(merge([json.loads(path.read_text()) for path in args.report]), args.docs)
        return
    if args.out is None:
        parser.error("--out is required (or --report)")
    study = SMOKE if args.smoke else Study()
    steps = sorted({int(s) for s in (args.steps or ("2,5" if args.smoke else DEFAULT_STEPS)).split(",")})
    if steps[0] < 0 or steps[-1] >= study.steps:
        parser.error(f"--steps must lie in 0..{study.steps - 1}, got {args.steps}")
    named = args.vocabs.split(",")
    if not set(named) <= set(VOCABS):
        parser.error(f"--vocabs takes names from {VOCABS}, comma-separated; got {args.vocabs!r}")
    args.vocabs = [v for v in VOCABS if v in named]  # in VOCABS' order
    args.vocab = SMOKE_BPE_VOCAB if args.smoke else BPE_VOCAB
    diagnose(args, study, steps)


if __name__ == "__main__":
    main(sys.argv[1:])
