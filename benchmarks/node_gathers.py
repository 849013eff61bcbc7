"""What `weight_sharding="node"` keeps gathered, counted on the CPU: the 6.7B GPT's bucket layout at
a small width, rank 0 of an emulated 16 x 4 job. No GPU and no timing: elements and counts.

    python benchmarks/node_gathers.py                         # gathers 1 and 2 ahead, width 64
    python benchmarks/node_gathers.py --prefetch 0,1,2 --markdown gathers.md

The model is the example GPT as `node_sharding.py` runs it at 6.7B (`6.7b-ckpt`: 32 layers, each
block's activations recomputed, the head tied to the token embedding) with every dimension that
sets a bucket scaled: the width 4096 -> `--width` (64 or more); the vocabulary (50304) and the
context (2048) by width / 4096, so that the embeddings scale as the blocks, by its square; and
bucket_numel and first_bucket_numel by (width / 4096)^2. Each bucket then holds the same
parameters as at 6.7B (the script checks it against the 6.7B layout, built on the meta device),
and its elements are the 6.7B bucket's over (4096 / width)^2, which the GiB columns undo.

Per `node_gather_prefetch`, over the last of `--steps` steps (the first has no learned order):
- **most gathered**: the largest sum of full buckets gathered or in flight inside the node at any
  moment of the forward (and the rest of the step outside the backward), and of the backward
  (recomputed forwards included), in layers (one
  block's weights) and in GiB of bf16 at 6.7B; and the buckets at that moment, each named by its
  largest parameter (`wte`: the token embedding's, which also holds wpe and the first LayerNorm);
- **gathers / unprefetched**: the intra-node gathers each pass started, and those a module waited
  for because no prefetch had started them;
- **around the logits**, where the step's activations are at their largest (the logits and their
  gradients, in fp32 for the loss): what is gathered during the loss's backward (as the forward
  left it), and the most gathered until the tied head's backward is done.

This is the node mode's own part of a step's memory. The rest (activations, gradients, the
exchanges' buffers) is the same in both modes, but where the step's peak lies, and so how much of
a change here reaches it, only a GPU run shows (`node_sharding.py --peak-profile`).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator

import torch
from cli_args import at_least, each_at_least
from emulated_runs import MODELS, ModelSpec
from emulation import Network
from gpt_step import VOCAB, engine_step, make_optimizer

from lightning_sdp4bit import SDP4BitConfig
from lightning_sdp4bit.buffers import bucket_layouts
from lightning_sdp4bit.config import auto_bucket_numel
from lightning_sdp4bit.engine import ShardedEngine
from lightning_sdp4bit.node_shards import NodeShards
from lightning_sdp4bit.topology import Topology

FULL = MODELS["6.7b-ckpt"]
NODES, RANKS_PER_NODE = 16, 4
PASSES = ("forward", "backward")
LOSS_BACKWARD, HEAD_BACKWARD = "at the loss's backward", "until the head's backward is done"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--prefetch", type=each_at_least(0), default=[1, 2], help="comma-separated node_gather_prefetch values"
    )
    parser.add_argument("--width", type=at_least(64), default=64, help="the scaled model's width (6.7B: 4096)")
    parser.add_argument("--steps", type=at_least(2), default=3, help="steps run; the last is reported")
    parser.add_argument("--markdown", help="also write the table to this file")
    args = parser.parse_args(argv)
    if args.width % 4:
        parser.error(f"argument --width: {args.width} is not a multiple of 4 (the scaled model's heads)")
    return args


def scaled_config(width: int, prefetch: int) -> tuple[ModelSpec, SDP4BitConfig]:
    """The scaled model and the config that cuts it into the 6.7B model's buckets."""
    scale = (width / FULL.n_embd) ** 2
    full_numel = sum(p.numel() for p in FULL.build(torch.device("meta")).parameters())
    defaults = SDP4BitConfig()
    factor = width / FULL.n_embd  # the vocabulary and the context scale as the width: so do their embeddings
    spec = ModelSpec(
        FULL.n_layer,
        width,
        batch=2,
        seq=round(FULL.seq * factor),
        n_head=4,
        vocab=round(VOCAB * factor),
        checkpoint=True,
    )
    config = SDP4BitConfig.preset(
        "sdp4bit",
        ranks_per_node=RANKS_PER_NODE,
        weight_sharding="node",
        node_gather_prefetch=prefetch,
        bucket_numel=max(1, round(auto_bucket_numel(full_numel) * scale)),
        first_bucket_numel=max(1, round(defaults.first_bucket_numel * scale)),
    )
    return spec, config


def same_layout_as_full(model: torch.nn.Module, config: SDP4BitConfig) -> bool:
    """Whether the scaled model's buckets hold the same parameters as the 6.7B model's."""
    world = NODES * RANKS_PER_NODE
    full = FULL.build(torch.device("meta"))
    full_layouts = bucket_layouts(
        list(full.named_parameters()), SDP4BitConfig.preset("sdp4bit", ranks_per_node=RANKS_PER_NODE), world
    )
    layouts = bucket_layouts(list(model.named_parameters()), config, world)
    names = [[slot.name for slot in layout.slots] for layout in layouts]
    return names == [[slot.name for slot in layout.slots] for layout in full_layouts]


class GatherWatch:
    """Per pass, the most bucket elements gathered or in flight at once (and which buckets), the
    gathers started and those waited for unprefetched, seen through NodeShards' own steps."""

    def __init__(self, sizes: list[int]):
        self.sizes = sizes
        self.moment: str | None = None  # a named stretch of the step, followed in `at_moments`
        self.at_moments: dict[str, int] = {}
        self.most: dict[str, tuple[int, list[int]]] = {}
        self.started: dict[str, int] = {}
        self.unprefetched: dict[str, int] = {}

    def reset(self) -> None:
        self.most = {name: (0, []) for name in PASSES}
        self.started = dict.fromkeys(PASSES, 0)
        self.unprefetched = dict.fromkeys(PASSES, 0)
        self.at_moments = {}

    def begin(self, moment: str | None, shards: NodeShards) -> None:
        """From now on, follow the most gathered as `moment` (None: stop following)."""
        self.moment = moment
        if moment is not None:
            self._seen(shards)

    def _seen(self, shards: NodeShards) -> None:
        held = [i for i, gathered in enumerate(shards.gathered) if gathered] + list(shards._landing)
        total, name = sum(self.sizes[i] for i in held), _pass()
        if total > self.most[name][0]:
            self.most[name] = (total, sorted(held))
        if self.moment is not None:
            self.at_moments[self.moment] = max(self.at_moments.get(self.moment, 0), total)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        start, land, release = NodeShards._start, NodeShards._land, NodeShards.release
        watch = self

        def watched_start(shards, index):
            start(shards, index)
            watch.started[_pass()] += 1
            watch._seen(shards)

        def watched_land(shards, index):
            watch.unprefetched[_pass()] += index not in shards._landing
            land(shards, index)

        def watched_release(shards, indices, keep=True):
            release(shards, indices, keep)
            watch._seen(shards)

        NodeShards._start, NodeShards._land, NodeShards.release = watched_start, watched_land, watched_release
        try:
            yield
        finally:
            NodeShards._start, NodeShards._land, NodeShards.release = start, land, release


def _pass() -> str:
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


def measure(width: int, prefetch: int, steps: int) -> dict:
    spec, config = scaled_config(width, prefetch)
    model = spec.build(torch.device("cpu")).float()
    topology = Topology(0, NODES * RANKS_PER_NODE, RANKS_PER_NODE)
    network = Network(torch.device("cpu"), topology, "shared")
    with network.install():
        engine = ShardedEngine(model, config, topology, network.groups(), device=torch.device("cpu"))
        try:
            sizes = [bucket.layout.used_numel for bucket in engine.buckets]
            names = [
                max(b.layout.slots, key=lambda slot: slot.numel).name.removesuffix(".weight") for b in engine.buckets
            ]
            watch = GatherWatch(sizes)
            _follow_the_logits(model, engine, watch)
            optimizer = make_optimizer(model.parameters(), torch.device("cpu"))
            engine.shard_optimizer(optimizer)
            tokens = spec.tokens(torch.device("cpu"))
            with watch.installed():
                for _ in range(steps):
                    watch.reset()
                    engine_step(model, engine, optimizer, tokens)
        finally:
            engine.close()
    layer = 12 * width * width + 13 * width  # a block's weights and biases (example GPT, 4x MLP)
    to_full_gib = (FULL.n_embd / width) ** 2 * 2 / 2**30
    return {
        "prefetch": prefetch,
        "same_layout": same_layout_as_full(model, config),
        "buckets": len(sizes),
        "around_the_logits_gib_at_6.7b": {moment: total * to_full_gib for moment, total in watch.at_moments.items()},
        "passes": {
            name: {
                "most_layers": watch.most[name][0] / layer,
                "most_gib_at_6.7b": watch.most[name][0] * to_full_gib,
                "buckets_at_most": [names[i] for i in watch.most[name][1]],
                "gathers": watch.started[name],
                "unprefetched": watch.unprefetched[name],
            }
            for name in PASSES
        },
    }


def _follow_the_logits(model: torch.nn.Module, engine: ShardedEngine, watch: GatherWatch) -> None:
    """Name the stretches around the logits: the loss's backward (from the step protocol's
    pre_backward, before any gather) and then the tied head's, until its backward hook."""
    shards = engine.primary.node_shards
    pre_backward = engine.pre_backward

    def watched_pre_backward() -> None:
        pre_backward()
        watch.begin(LOSS_BACKWARD, shards)
        watch.begin(HEAD_BACKWARD, shards)

    engine.pre_backward = watched_pre_backward
    model.lm_head.register_full_backward_hook(lambda *_: watch.begin(None, shards))


def report(results: list[dict], width: int) -> str:
    lines = [
        f'weight_sharding="node", the 6.7B GPT\'s buckets at width {width}, rank 0 of {NODES} x {RANKS_PER_NODE}:',
        "",
        "| gathers ahead | pass | most gathered (layers) | most gathered at 6.7B (GiB) | gathers | unprefetched "
        "| buckets at the most (largest parameter) |",
        "|---|---|---|---|---|---|---|",
    ]
    for result in results:
        for name, figures in result["passes"].items():
            lines.append(
                f"| {result['prefetch']} | {name} | {figures['most_layers']:.2f} | {figures['most_gib_at_6.7b']:.2f} "
                f"| {figures['gathers']} | {figures['unprefetched']} | {', '.join(figures['buckets_at_most'])} |"
            )
    lines += [
        "",
        "Around the logits, gathered or in flight (GiB at 6.7B):",
        "",
        f"| gathers ahead | {LOSS_BACKWARD} | {HEAD_BACKWARD} |",
        "|---|---|---|",
    ]
    for result in results:
        around = result["around_the_logits_gib_at_6.7b"]
        lines.append(f"| {result['prefetch']} | {around[LOSS_BACKWARD]:.2f} | {around[HEAD_BACKWARD]:.2f} |")
    if not all(result["same_layout"] for result in results):
        lines += ["", "WARNING: the scaled model's buckets differ from the 6.7B model's; the GiB columns do not apply."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results = [measure(args.width, prefetch, args.steps) for prefetch in args.prefetch]
    emit(report(results, args.width), args.markdown)


def emit(table: str, markdown: str | None) -> None:
    """Print the table, and write it to `markdown` if given."""
    print(table, flush=True)
    if markdown:
        with open(markdown, "w") as handle:
            handle.write(table + "\n")


if __name__ == "__main__":
    sys.exit(main())
