"""Where a simulated W-rank step spends its time on a GPU, and what a CUDA graph of one rank's
forward and backward would save (and whether it gives the eager pass's bits).

    python benchmarks/simulation_profile.py [--world 16x4] [--preset sdp4bit] [--streams 2]

Prints the step's phases (host clock around each, the device synchronised between them): the W
ranks' forward + backward (replayed from CUDA graphs, --streams at once) with their gradient
intake, the exchanges and verdict, the optimizer steps, the weight exchange; then one rank's
forward + backward replayed from a CUDA graph.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from cli_args import at_least, simulated_world

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from accuracy_gpu import PRESETS, RankPasses, Study, build  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=simulated_world, default="16x4")
    parser.add_argument("--preset", default="sdp4bit", choices=PRESETS)
    parser.add_argument("--streams", type=at_least(1), default=2, help="ranks whose graphs replay at once")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("this profile needs a GPU: it replays CUDA graphs")
    study = Study(world=args.world)
    device = torch.device("cuda")
    model, engine, optimizer, _ = build(study, args.preset, 0, device)
    x = torch.randint(0, 256, (study.ranks, study.block_size + 1), device=device)
    params = [p for p in model.parameters() if p.requires_grad]

    def loss_of(tokens):
        return F.cross_entropy(model(tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten())

    phases: dict[str, float] = {}

    def timed(name, fn):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - start

    passes = RankPasses(model, engine, x[:1], graphed=True, streams=args.streams)
    losses = torch.zeros((), device=device)

    def step():
        timed("forward + backward (graphs) + gradient intake", lambda: passes.step(x[:, None], losses))
        timed("exchanges + verdict", engine.finish_grad_sync)
        timed("clip + prepare", lambda: (engine.clip_grad_norm(1.0), engine.prepare_step()))
        timed("optimizer steps", lambda: (optimizer.step(), engine.step_other_ranks()))
        timed("weight exchange", engine.start_weight_sync)
        optimizer.zero_grad()

    step()
    phases.clear()
    for _ in range(3):
        step()
    print(f"| phase ({args.preset}, {args.world}) | ms per step |\n|---|---|")
    for name, seconds in phases.items():
        print(f"| {name} | {1e3 * seconds / 3:.1f} |")
    print(f"| total | {1e3 * sum(phases.values()) / 3:.1f} |")

    # One rank's forward + backward: eager, eager again, and replayed from a CUDA graph.
    def grads_of(tokens):
        for p in params:
            p.grad = None
        loss_of(tokens).backward()
        return [p.grad.clone() for p in params]

    passes = None
    eager, again = grads_of(x[:1]), grads_of(x[:1])
    static = x[:1].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            for p in params:
                p.grad = None
            loss_of(static).backward()
    torch.cuda.current_stream().wait_stream(side)
    for p in params:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss_of(static).backward()
    graph.replay()
    replayed = [p.grad.clone() for p in params]
    same = all(torch.equal(a, b) for a, b in zip(eager, again, strict=True))
    graph_same = all(torch.equal(a, b) for a, b in zip(eager, replayed, strict=True))
    print(f"eager twice bit-identical: {same}; graph replay bit-identical to eager: {graph_same}")
    for name, fn in [("eager", lambda: loss_of(static).backward()), ("graph replay", graph.replay)]:
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        print(f"one rank's forward + backward, {name}: {1e3 * (time.perf_counter() - start) / 20:.2f} ms")


if __name__ == "__main__":
    main()
