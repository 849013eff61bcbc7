"""Bytes on the wire: what this rank puts into each collective, per step and since the start.

A collective's cost is counted from the input this rank passes (an all-to-all's input includes
the chunk a rank keeps for itself, as the paper's bit counts do). Next to each figure the meter
keeps what the uncompressed path would have passed for the same bucket (the weights' dtype for
the all-gather, fp32 for the reduce-scatter), so the ratio is like for like.

Kinds: "weight" (the weight all-gather; with several nodes of several ranks, its first stage,
across nodes), "weight_intra" (that all-gather's second stage, inside the node), "grad_intra"
and "grad_inter" (the two all-to-alls of the two-level reduce-scatter) and
"grad_reduce_scatter" (the fp32 reduce-scatter).
"""

from __future__ import annotations

from collections import defaultdict

__all__ = ["KINDS", "WireMeter"]

KINDS = ("weight", "weight_intra", "weight_gather", "grad_intra", "grad_inter", "grad_reduce_scatter")


class WireMeter:
    def __init__(self) -> None:
        self._bytes: dict[str, int] = defaultdict(int)
        self._elements: dict[str, int] = defaultdict(int)
        self._uncompressed = 0
        self.total_bytes = 0
        self.total_uncompressed_bytes = 0
        self.last_step: dict[str, float] = {}

    def record(self, kind: str, nbytes: int, elements: int, uncompressed_nbytes: int) -> None:
        """Count one collective: `nbytes` passed for `elements` values that would cost
        `uncompressed_nbytes` uncompressed (what the uncompressed path would pass for the same
        stage: with several nodes of several ranks it goes in two levels as well)."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self._bytes[kind] += nbytes
        self._elements[kind] += elements
        self._uncompressed += uncompressed_nbytes

    def end_step(self) -> dict[str, float]:
        """Close the current optimizer step and return its figures (also kept in `last_step`)."""
        step_bytes = sum(self._bytes.values())
        self.total_bytes += step_bytes
        self.total_uncompressed_bytes += self._uncompressed
        stats: dict[str, float] = {}
        for kind in KINDS:
            stats[f"{kind}_bytes"] = self._bytes.get(kind, 0)
            elements = self._elements.get(kind, 0)
            stats[f"{kind}_bits_per_element"] = 8 * self._bytes[kind] / elements if elements else 0.0
        stats.update(
            step_bytes=step_bytes,
            step_uncompressed_bytes=self._uncompressed,
            total_bytes=self.total_bytes,
            total_uncompressed_bytes=self.total_uncompressed_bytes,
            compression_ratio=self._uncompressed / step_bytes if step_bytes else 1.0,
        )
        self._bytes.clear()
        self._elements.clear()
        self._uncompressed = 0
        self.last_step = stats
        return stats

    def state_dict(self) -> dict[str, int]:
        return {"total_bytes": self.total_bytes, "total_uncompressed_bytes": self.total_uncompressed_bytes}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.total_bytes = int(state["total_bytes"])
        self.total_uncompressed_bytes = int(state["total_uncompressed_bytes"])
