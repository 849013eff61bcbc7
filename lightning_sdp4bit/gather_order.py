"""The order in which a pass needs buckets gathered inside the node, learned from the last pass.

Under `weight_sharding="node"` a bucket's gather should start `node_gather_prefetch` buckets
before a module needs it. Which buckets come next is easy to guess in a forward (the next lower
indices: buckets are filled from the last parameters) and wrong in a backward with activation
checkpointing: there each block's forward runs again first, in forward order (descending
indices), then its backward (ascending), then the previous block's recomputation starts at that
block's *first* bucket, not at the one next to the last bucket used. Guessed by index, most of
a block's recomputed gathers wait on NVLink unprefetched (on 4 blocks of 5 buckets, 14 gathers a
backward with two ahead, 17 with one; learned, 1), and the next block's last buckets are fetched
early and held through this block's backward.

So the node slices record, per kind of pass (a forward; a backward with its recomputed forwards),
the order in which the pass first needed each bucket, and prefetch the next pass of that kind in
that order (as FSDP1 records its first iteration's execution order to prefetch by). Every rank of
a node runs the same modules in the same order, so every rank starts the same gathers: they stay
collective. Until a pass of its kind has been seen (the first step), or when a pass needs a
bucket its plan does not hold (control flow that changed), the guess by index is used.

A bucket released and needed again in the same pass (a GPT's token-embedding bucket, which its
first LayerNorm shares: gathered for the tied head's backward, then for the first block's) is
not prefetched the second time. Prefetched, its 0.40 GiB (at 6.7B) was held through the second
block's backward, and the most gathered at once in a backward rose from 0.78 to 1.04 GiB
(`benchmarks/node_gathers.py`); unprefetched, it waits for one gather (about 2 ms of NVLink).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["GatherOrder"]


class GatherOrder:
    """Per kind of pass (`backward`: False for a forward, True for a backward), the order of the
    last such pass's needs and that of the pass in progress."""

    def __init__(self) -> None:
        self._plans: dict[bool, list[int]] = {False: [], True: []}
        self._positions: dict[bool, dict[int, int]] = {False: {}, True: {}}  # bucket -> place in its plan
        self._recording: dict[bool, dict[int, None]] = {False: {}, True: {}}  # first needs, in order
        self._reached: dict[bool, int] = {False: -1, True: -1}  # the furthest place in its plan this pass has been

    def needed(self, indices: Sequence[int], backward: bool) -> None:
        recording = self._recording[backward]
        for index in indices:
            recording.setdefault(index)

    def after(self, indices: Sequence[int], backward: bool, count: int) -> list[int] | None:
        """The `count` buckets the plan needs next, after the furthest of its places this pass has
        reached (`indices` among them); None where there is no plan for this kind of pass or it
        does not hold one of `indices`. Furthest, not `indices`' own: a backward needs a bucket
        again for its gradients after it needed it for the recomputed forward, and the buckets
        between the two needs are done with by then."""
        positions = self._positions[backward]
        if not positions or any(index not in positions for index in indices):
            return None
        self._reached[backward] = max(self._reached[backward], *(positions[index] for index in indices))
        start = self._reached[backward] + 1
        return self._plans[backward][start : start + count]

    def forward_starts(self) -> None:
        """What was gathered since the last backward (a callback's reads, a validation loop) is
        no training forward's order."""
        self._recording[False] = {}
        self._reached[False] = -1

    def forward_done(self) -> None:
        """Between a forward and its backward: this forward's order is the next forward's plan,
        and the last backward's the next backward's."""
        for backward, recording in self._recording.items():
            if recording:
                self._plans[backward] = list(recording)
                self._positions[backward] = {index: place for place, index in enumerate(recording)}
            self._recording[backward] = {}
        self._reached[True] = -1
