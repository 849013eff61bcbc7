"""The life of a bucket, named in one place: when its gradients and its weights are final.

Per optimizer step, every bucket goes through two phases of its own (N elements, S = N / world):

    gradients:  ACCUMULATING --launch--> EXCHANGING --wait--> REDUCED --discard--> ACCUMULATING
    weights:    CURRENT --start--> EXCHANGING --wait--> CURRENT

- ACCUMULATING: micro-batch gradients are put into the bucket's window gradients [N]
  (`buffers.Bucket.receive_grad`).
- gradients EXCHANGING: the reduce-scatter (plain, or the two quantized all-to-alls) is in flight;
  it took the window gradients, so a gradient arriving now has nowhere to go (an error).
- REDUCED: this rank's gradient shard [S] holds the averaged gradient; the optimizer may step.
- weights EXCHANGING: the all-gather of the updated shards is in flight; the model weights [N]
  must be neither read nor written until it completes.
- weights CURRENT: the model weights are the ones the next forward uses, identical on every rank.

`BucketSchedule` holds these phases and the pending exchanges, and is the only place that waits
on communication. Its rules:
- gradient exchanges start strictly in bucket order (0, 1, ...), so every rank issues the same
  collectives in the same order whatever its backward order;
- a multi-stage exchange moves to its next stage only when its current stage has completed
  (`Work.is_completed()`), so polling never blocks the caller (nor, on CUDA, its stream), and
  only after every earlier bucket's has moved on: each group's collectives then go out in
  bucket order on every rank, whichever stage completes first where;
- weight exchanges go out in reverse bucket order (the first layers, which forward needs
  first, are in the last bucket). With `weight_prefetch = k`, `start_weights` only marks them
  due and starts the first k; each wait then starts the due ones up to k past the bucket it
  waits for (a forward pre-hook's wait). On a GPU the host thus returns to launching forward
  after k exchanges instead of after all of them: after the step's host synchronisation the
  GPU would otherwise idle while the host launches every bucket's encode kernel and collective.
  With None every exchange starts at once (the CPU, where a wait blocks the host itself);
- weight exchanges complete in launch order, and a two-level one's second stage goes out (from
  `progress` or `wait`) only after every earlier one's: for the same reason as the gradients'.

The waits Lightning's hooks need (weights complete before a callback reads them, gradients
reduced before a hook sees them) are calls of `wait_weights` and `finish_grads`. Every wait and
every move to a next stage runs in `comm.Timeouts.named`, so that a peer's stall surfaces as one
error naming the bucket and its exchange, whatever the backend's words.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from enum import Enum

import torch
from torch.profiler import record_function

from lightning_sdp4bit.collectives import Pending
from lightning_sdp4bit.comm import Timeouts

__all__ = ["BucketSchedule", "GradPhase", "WeightPhase", "WindowPhase", "exchange_stream"]


def exchange_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The one side stream of an engine on a GPU (None elsewhere): the middle stage of every
    two-level gradient exchange and the second stage of every two-level weight all-gather are
    queued there, ordered by the network's completion events rather than by the host
    (`collectives.TwoStage`). The compute stream
    waits on it only where a result is needed: the gradient shards in `finish_grads`, a
    bucket's weights in its wait."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


class GradPhase(str, Enum):
    ACCUMULATING = "accumulating"  # gradients are being put into the window gradients
    EXCHANGING = "exchanging"  # the reduce-scatter is in flight
    REDUCED = "reduced"  # the gradient shard is final for this step


class WeightPhase(str, Enum):
    CURRENT = "current"  # the weights are complete and current on every rank
    EXCHANGING = "exchanging"  # the all-gather is in flight: do not read or write the weights


class WindowPhase(str, Enum):
    """Where one rank's accumulation window (the gradients of one optimizer step) is; the buckets'
    phases above say where each bucket's exchanges are within it. Moves (`rank.ShardedRank`):

        OPEN --reduce--> REDUCED --arm--> ARMED | SKIPPING --step--> STEPPED --zero_grad--> OPEN

    and from any phase back to OPEN on zero_grad; a backward in REDUCED, ARMED or SKIPPING carries
    the reduced gradients into the new window (DDP adds to them); one in STEPPED starts afresh.
    """

    OPEN = "open"  # gradients arrive into the window gradients; nothing reduced yet
    REDUCED = "reduced"  # every exchange complete and the verdict taken: the fragments' .grad are the shards
    ARMED = "armed"  # weight edits in the masters and the verdict applied: the optimizer steps
    SKIPPING = "skipping"  # as ARMED, but the host skips this step (a non-finite gradient, nonfinite="skip")
    STEPPED = "stepped"  # the optimizer stepped and the weight exchange started; still reduced


class BucketSchedule:
    """Phases and pending exchanges of `count` buckets.

    `start_grads(index)` and `start_weights(index)` are callables that launch one bucket's
    exchange and return its `Pending`; `on_weights_current(index)` runs once a bucket's new
    weights have landed (the engine takes its parameters' version counters then, the reference
    for in-place edit checks with the applied shard that the exchange left).
    `timeouts`: this rank and its groups' timeout, for the error of a wait that times out.
    """

    def __init__(
        self,
        count: int,
        start_grads: Callable[[int], Pending],
        start_weights: Callable[[int], Pending],
        on_weights_current: Callable[[int], None],
        weight_prefetch: int | None = None,
        timeouts: Timeouts | None = None,
    ):
        self.count = count
        self._timeouts = timeouts if timeouts is not None else Timeouts()
        self._prefetch = weight_prefetch
        self._start_grads, self._start_weights = start_grads, start_weights
        self._on_weights_current = on_weights_current
        self.grad_phase = [GradPhase.ACCUMULATING] * count
        self._next_launch = 0  # the next bucket whose gradient exchange may start
        self._reduced = 0  # buckets in REDUCED
        self._grads: dict[int, Pending] = {}
        # The gradient exchanges in flight that `poll` has not yet seen move on, in launch (=
        # bucket) order: one that has moved on stays so, and is not asked again (asking every
        # one in flight after each launch was O(buckets^2) calls a step).
        self._grads_unmoved: collections.deque[tuple[int, Pending]] = collections.deque()
        self._weights: dict[int, Pending] = {}
        self._weights_unmoved: collections.deque[tuple[int, Pending]] = collections.deque()  # as the gradients'
        self._weights_due: list[int] = []  # buckets whose all-gather is due but not started, in launch order

    # ----------------------------------------------------------------------------------------
    # Gradients

    @property
    def grads_reduced(self) -> bool:
        return self._reduced == self.count

    @property
    def grads_exchanging(self) -> bool:
        return bool(self._grads)

    def launch_ready(self, ready: Callable[[int], bool]) -> None:
        """Start the gradient exchanges of the next buckets in order, as long as `ready(index)`;
        after a launch, move the earlier ones on. (Polling on every parameter's gradient instead
        cost a query per exchange in flight each time: about 10 ms a step for a 356M GPT.)"""
        launched = False
        while self._next_launch < self.count and ready(self._next_launch):
            self._launch(self._next_launch)
            launched = True
        if launched:
            self.poll()

    def _launch(self, index: int) -> None:
        with record_function("sdp4bit::grad_exchange_start"):
            self._grads[index] = self._start_grads(index)
        self._grads_unmoved.append((index, self._grads[index]))
        self.grad_phase[index] = GradPhase.EXCHANGING
        self._next_launch = index + 1

    def poll(self) -> None:
        """Move in-flight multi-stage exchanges on, in bucket order, up to the first whose current
        stage has not completed. In order, because the next stage is a collective on another
        group: a later bucket's first stage may complete first on one rank and not on another
        (gloo runs its work on several threads), and ranks that launched the second stages in
        different orders would pair different buckets' payloads of one size without an error."""
        unmoved = self._grads_unmoved
        while unmoved:
            index, exchange = unmoved[0]
            with self._timeouts.named("gradient reduce-scatter", index):
                if not exchange.progress():
                    return
            unmoved.popleft()

    def launch_all_grads(self) -> None:
        """Launch every gradient exchange not yet launched, in order (those whose parameters got no
        gradient in the synced backward, or all of them when nothing was sent during backward)."""
        while self._next_launch < self.count:
            self._launch(self._next_launch)

    def finish_grads(self) -> None:
        """Launch what is left (in order), then wait for every gradient exchange: REDUCED."""
        self.launch_all_grads()
        for index in sorted(self._grads):
            with self._timeouts.named("gradient reduce-scatter", index), record_function("sdp4bit::grad_exchange_wait"):
                self._grads.pop(index).wait()
            self.grad_phase[index] = GradPhase.REDUCED
            self._reduced += 1
        self._grads_unmoved.clear()

    def restart_grads(self) -> None:
        """A new accumulation window: every bucket back to ACCUMULATING."""
        if self._grads:
            raise RuntimeError("cannot start a new gradient window while reduce-scatters are in flight")
        self.grad_phase = [GradPhase.ACCUMULATING] * self.count
        self._next_launch = 0
        self._reduced = 0

    # ----------------------------------------------------------------------------------------
    # Weights

    @property
    def weight_phase(self) -> list[WeightPhase]:
        """Each bucket's weight phase, read off the exchanges due or in flight."""
        exchanging = set(self.exchanging_weights())
        return [WeightPhase.EXCHANGING if i in exchanging else WeightPhase.CURRENT for i in range(self.count)]

    @property
    def weights_current(self) -> bool:
        return not self._weights and not self._weights_due

    def start_weights(self) -> None:
        """Every bucket's weights become EXCHANGING; the all-gathers go out, the first layers'
        (the last bucket) first, all at once or `weight_prefetch` ahead of the waits."""
        self.wait_weights()
        self._weights_due = list(reversed(range(self.count)))
        self._launch_due(self.count if self._prefetch is None else self._prefetch)

    def _launch_due(self, count: int) -> None:
        while self._weights_due and count > 0:
            index = self._weights_due.pop(0)
            with record_function("sdp4bit::weight_exchange_start"):
                self._weights[index] = self._start_weights(index)
            self._weights_unmoved.append((index, self._weights[index]))
            count -= 1

    def wait_weights(self, indices: Iterable[int] | None = None) -> None:
        """Complete the all-gathers of `indices` (default: all), and every one launched before
        them: their weights become CURRENT. Due exchanges up to `weight_prefetch` past the last
        of them are started first; the ones still in flight after are moved on, in order."""
        targets = list(range(self.count)) if indices is None else list(indices)
        if self._weights_due and targets:
            # Launch order is count-1, ..., 0: bucket i is the (count-1-i)-th to go out.
            needed = self.count - min(targets) + (self._prefetch or 0)
            self._launch_due(needed - (self.count - len(self._weights_due)))
        wanted = [index for index in targets if index in self._weights]
        if wanted:
            order = list(self._weights)  # launch order
            for index in order[: max(order.index(i) for i in wanted) + 1]:
                with self._timeouts.named("weight all-gather", index), record_function("sdp4bit::weight_exchange_wait"):
                    self._weights.pop(index).wait()
                self._on_weights_current(index)
        self.poll_weights()

    def poll_weights(self) -> None:
        """Move the weight exchanges still in flight on, in launch order, up to the first whose
        current stage has not completed (as `poll` does the gradients')."""
        unmoved = self._weights_unmoved
        while unmoved:
            index, exchange = unmoved[0]
            if self._weights.get(index) is exchange:  # still in flight
                with self._timeouts.named("weight all-gather", index):
                    if not exchange.progress():
                        break
            unmoved.popleft()  # completed above, or moved on now

    def exchanging_weights(self) -> list[int]:
        return sorted([*self._weights, *self._weights_due])
