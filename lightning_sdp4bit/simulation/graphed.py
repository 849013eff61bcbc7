"""One rank's forward and backward, replayed from a CUDA graph, for a simulated job on a GPU.

A simulated job runs W small backward passes per step (one per rank's micro-batch), and at small
micro-batches each is bound by the host's kernel launches, not by the GPU: for the 12 x 768 GPT
at one sequence of 1024 tokens on the H200, 19.1 ms eager against 3.4 ms replayed from a graph
(benchmarks/simulation_profile.py). A graph replays the very kernels the eager pass launches, so
its gradients are the eager ones bit for bit (checked there, and in
tests/unit/test_simulation_gpu.py).

    step = GraphedBackward(lambda tokens: loss_of(model, tokens), example_tokens, params)
    loss, grads = step(tokens_of_rank)         # grads: static tensors, overwritten by the next call
    engine.receive_grads(rank, accumulating, grads)

`GraphedRanks` holds a few copies of that graph and replays them on as many streams at once: a
pass of one sequence leaves much of an H200 idle (a 768-wide projection of 1024 tokens is 48
tiles of 128 x 128 for 132 SMs), which passes side by side can fill
(`benchmarks/simulation_profile.py --streams N` measures it). Every copy runs the same kernels on
its own memory, so the gradients are the same bits; the caller takes them in rank order on its
own stream.

What a graph cannot do: a micro-batch of another shape (each shape needs its own graph), work on
the host inside forward (data-dependent Python control flow is frozen at capture), or anything
that needs the RNG to differ between ranks (dropout would draw the same mask for every rank);
`GraphedBackward` refuses a shape it was not captured for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

__all__ = ["GraphedBackward", "GraphedRanks"]


class GraphedBackward:
    """loss_fn(tokens) -> scalar loss, captured with its backward for `example`'s shape and dtype."""

    def __init__(self, loss_fn: Callable[[Tensor], Tensor], example: Tensor, params: Sequence[nn.Parameter]):
        if not example.is_cuda:
            raise ValueError("GraphedBackward needs CUDA tensors: CUDA graphs exist only on a GPU")
        self._params = list(params)
        self._input = example.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph: allocator, autotuning, lazy init
            for _ in range(3):
                self._clear()
                loss_fn(self._input).backward()
        torch.cuda.current_stream().wait_stream(side)
        used = [p.grad is not None for p in self._params]
        self._clear()
        self._graph = torch.cuda.CUDAGraph()
        # Captured on a stream of its own: cuBLAS keeps one workspace per (handle, stream) and a graph
        # replays with its capture's, so graphs that replay at the same time (GraphedRanks) must
        # not share a capture stream.
        with torch.cuda.graph(self._graph, stream=torch.cuda.Stream()):
            self._loss = loss_fn(self._input)
            self._loss.backward()
        # The gradients the graph writes at every replay, in `params` order (None: no gradient).
        self.grads: list[Tensor | None] = [p.grad if u else None for p, u in zip(self._params, used, strict=True)]
        self._clear()

    def _clear(self) -> None:
        for param in self._params:
            param.grad = None

    def __call__(self, tokens: Tensor) -> tuple[Tensor, list[Tensor | None]]:
        """Replay on `tokens`; returns (the loss, the gradients): both static, valid until the next call."""
        if tokens.shape != self._input.shape or tokens.dtype != self._input.dtype:
            raise ValueError(
                f"GraphedBackward was captured for a micro-batch of shape {tuple(self._input.shape)} and "
                f"{self._input.dtype}, got {tuple(tokens.shape)} and {tokens.dtype}"
            )
        self._input.copy_(tokens)
        self._graph.replay()
        return self._loss, self.grads


class GraphedRanks:
    """`copies` GraphedBackward of one loss, replayed on `copies` streams at once, for the ranks of
    a simulated job one after another.

        ranks = GraphedRanks(loss_fn, example, params, copies=2)
        ranks.run(micro_batches, take)      # take(i, loss, grads) for i = 0, 1, ... in order

    Micro-batch i replays copy i % copies on that copy's stream, once the caller has taken what
    the copy's previous replay wrote. `take` runs on the caller's stream after micro-batch i's
    replay, and must read the loss and gradients there (enqueue its copies), not keep them: the
    copy's next replay overwrites them once the caller's stream is past `take`'s work.
    """

    def __init__(
        self, loss_fn: Callable[[Tensor], Tensor], example: Tensor, params: Sequence[nn.Parameter], copies: int = 2
    ):
        if copies < 1:
            raise ValueError(f"copies must be at least 1, got {copies}")
        self._streams = [torch.cuda.Stream() for _ in range(copies)]
        self._graphs = [GraphedBackward(loss_fn, example, params) for _ in range(copies)]

    def run(self, micro_batches: Sequence[Tensor], take: Callable[[int, Tensor, list[Tensor | None]], None]) -> None:
        caller = torch.cuda.current_stream()
        inputs_ready = caller.record_event()  # micro_batches were written on the caller's stream
        taken: list[torch.cuda.Event | None] = [None] * len(self._graphs)
        for stream in self._streams:
            stream.wait_event(inputs_ready)
        for index, tokens in enumerate(micro_batches):
            copy = index % len(self._graphs)
            stream = self._streams[copy]
            previous = taken[copy]
            if previous is not None:
                stream.wait_event(previous)
            with torch.cuda.stream(stream):
                loss, grads = self._graphs[copy](tokens)
            caller.wait_event(stream.record_event())
            take(index, loss, grads)
            taken[copy] = caller.record_event()
