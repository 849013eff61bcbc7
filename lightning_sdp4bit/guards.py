"""What every rank must agree on before an optimizer step, decided without stalling the host.

After the gradient exchange each rank holds the averaged gradient of its own shards only, so
three facts about the step are global and must come out the same on every rank, or the ranks'
optimizer states (and then their collectives) would diverge:
- the global 2-norm of the gradient, for clipping: an all-reduce of the ranks' sums of squares
  on the gradients' device, read by nobody on the host (clipping scales on the device);
- whether any gradient element is non-finite (Inf or NaN), for `SDP4BitConfig.nonfinite`: a
  non-finite element makes its shard's sum of squares, and so the global one, Inf or NaN. The
  quantized exchanges carry it there: an Inf or NaN makes its group's fp32 scale non-finite
  (the kernels' absmax propagates NaN). `nonfinite_flag` is that fact as a device tensor
  (1.0 or 0.0), for optimizers that can skip on the device; `finite` reads it on the host;
- which trained parameters received a gradient on at least one rank in the accumulation
  window (the others get `grad = None`, so the optimizer skips them, as under DDP): the host
  knows its own usage, so a small all-reduce of a CPU bitmap over a CPU (gloo) group agrees on
  it with no GPU synchronisation.

One fact is local and checked before each backward: no parameter frozen when the engine was
built requires grad now (it has no bucket, so its gradient would be dropped silently:
`unfrozen_since_start`).

A host synchronisation after backward would leave the GPU idle while the host launches the
optimizer step, the weight exchanges and the next forward (measured on the H200: about 8 ms a
step for a 356M GPT); only `finite` makes one, and only where it is needed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_sdp4bit import comm
from lightning_sdp4bit.config import NonFinite, SDP4BitConfig

if TYPE_CHECKING:
    from lightning_sdp4bit.rank import ShardedRank

__all__ = [
    "NonFiniteGradientError",
    "NonFiniteStateError",
    "describe_nonfinite",
    "finite_flags",
    "PendingSum",
    "PendingVerdict",
    "SkippedSteps",
    "StepVerdict",
    "apply_verdict",
    "check_state_finite",
    "clip_coefficient",
    "local_squares",
    "start_sum",
    "start_verdict",
    "stop_if_skipping_cannot_recover",
    "unfrozen_since_start",
]


log = logging.getLogger(__name__)


class SkippedSteps:
    """How many optimizer steps were skipped for non-finite gradients (nonfinite="skip").

    Steps the host skips are counted on the host. Steps a fused optimizer skips on the device
    (`found_inf`) are counted on the device and read one step late (`lagging`), so that counting
    never synchronises the host; `exact` reads them now (a synchronisation, for checkpoints).
    """

    def __init__(self, device: torch.device, rank: int):
        self.on_host, self._rank, self._logged = 0, rank, 0
        self._on_device = torch.zeros((), dtype=torch.float32, device=device)
        self._read = torch.zeros((), dtype=torch.float32, pin_memory=device.type == "cuda")
        self.in_a_row = 0  # steps skipped in a row, as `lagging` last counted them
        self.since: int | None = None  # the first of them
        self.grew = False  # whether the last `lagging` counted a new one
        self._previous = 0  # the total the last `lagging` returned

    def host_skip(self, step: int) -> None:
        self.on_host += 1
        if self._rank == 0:
            log.warning(
                "sdp4bit: non-finite gradient at optimizer step %d: step skipped (masters, optimizer state and "
                "weights unchanged; %d skipped so far)",
                step,
                self.on_host,
            )

    def device_skip(self, flag: Tensor) -> None:
        """`flag`: the verdict's device tensor, 1.0 when the fused optimizers skip this step."""
        self._on_device += flag

    def lagging(self, step: int) -> int:
        """The total as of about one step ago (the copy issued last call has landed by now), at the
        end of optimizer step `step`; also counts the steps skipped in a row. A host skip is
        counted at its own step, a device skip one step later (so its streak starts at step - 1)."""
        landed = int(self._read.item())
        self._read.copy_(self._on_device, non_blocking=True)
        if landed > self._logged and self._rank == 0:
            log.warning("sdp4bit: %d optimizer steps skipped so far for non-finite gradients", landed)
        total = self.on_host + landed
        self.grew = total > self._previous
        if self.grew:
            if self.in_a_row == 0:
                self.since = step if landed == self._logged else step - 1
            self.in_a_row += total - self._previous
        else:
            self.in_a_row, self.since = 0, None
        self._logged, self._previous = landed, total
        return total

    def exact(self) -> int:
        return self.on_host + int(self._on_device.item())

    def restore(self, total: int) -> None:
        """Continue counting from a checkpoint's `exact()`."""
        self.on_host, self._logged, self._previous = total, 0, total
        self.in_a_row, self.since, self.grew = 0, None, False
        self._on_device.zero_()
        self._read.zero_()


class NonFiniteGradientError(FloatingPointError):
    """Raised on every rank, at the same step, when `nonfinite="error"` and a gradient is Inf or NaN,
    or when more steps than `nonfinite_skip_limit` were skipped in a row."""


class NonFiniteStateError(FloatingPointError):
    """Raised on every rank when fp32 masters or model weights hold Inf or NaN (a hook wrote them):
    no step can recover, and no checkpoint may hold them. Names the parameters and the ranks."""


def finite_flags(fragments: Iterable[Any], buckets: Iterable[Any], world: int, rank: int, params: int) -> Tensor:
    """[world, 2, params] int32 on the host, zero but for row `rank`: per trained parameter
    (bucket order), 1 where its masters on this rank (column 0) or the weights this rank holds
    (column 1: its replica, or its node slice) hold an Inf or NaN. One host synchronisation; for
    a sum over the ranks."""
    checks, where = [], []
    for record in fragments:
        checks.append(torch.isfinite(record.master).all())
        where.append((0, record.param_index))
    offset = 0
    for bucket in buckets:
        for position, _, values in bucket.held_pieces():
            checks.append(torch.isfinite(values).all())
            where.append((1, offset + position))
        offset += len(bucket.layout.slots)
    flags = torch.zeros(world, 2, params, dtype=torch.int32)
    for (kind, index), finite in zip(where, torch.stack(checks).tolist(), strict=True):
        if not finite:  # a node slice holds a parameter in several pieces: any one flags it
            flags[rank, kind, index] = 1
    return flags


def check_state_finite(ranks: list[ShardedRank], names: list[str], when: str) -> None:
    """Raise NonFiniteStateError on every rank, naming the parameters (`names`: the trained ones,
    in bucket order) and the ranks, if any rank's fp32 masters or model weights hold Inf or NaN.
    Collective: each of `ranks` (the engine's) starts its sum before any waits."""
    pending = [rank.start_finite_check() for rank in ranks]
    flags = [rank.finish_finite_check(sums) for rank, sums in zip(ranks, pending, strict=True)][0]
    if flags.any():
        raise NonFiniteStateError(
            f"sdp4bit: {when}, parameters {describe_nonfinite(flags, names)} hold Inf or NaN. Non-finite "
            "weights make every later gradient non-finite, so no step can recover: every rank stops here, "
            "before a checkpoint can hold them. A hook or callback that writes the weights (a clamp, an "
            "average copied in, a load) may have written them."
        )


def stop_if_skipping_cannot_recover(ranks: list[ShardedRank], config: SDP4BitConfig, names: list[str]) -> None:
    """Skipping is right for a transient overflow, not for a state no step can leave: after a step
    skipped for non-finite gradients (nonfinite="skip"), stop every rank if the masters or weights
    hold Inf or NaN (a hook wrote them), or if `config.nonfinite_skip_limit` steps in a row were
    skipped. Collective, on skipped steps only (every rank counts the same skips)."""
    skipped = ranks[0].skipped
    if config.nonfinite is not NonFinite.SKIP or not skipped.grew:
        return
    streak = f"{skipped.in_a_row} optimizer step(s) skipped in a row since step {skipped.since}"
    check_state_finite(ranks, names, f"after {streak}")
    limit = config.nonfinite_skip_limit
    if limit and skipped.in_a_row >= limit:
        raise NonFiniteGradientError(
            f"sdp4bit: {streak}, every one for a non-finite gradient, with finite masters and weights: the run is "
            f"not training (nonfinite_skip_limit={limit}). Find the batch or layer that overflows, or raise the "
            "limit (0: no limit)."
        )


def describe_nonfinite(flags: Tensor, names: list[str]) -> str:
    """Which parameters `flags` (summed `finite_flags`) marks, where: "a (masters on ranks [0])"."""
    found = []
    for index in (flags.sum(dim=(0, 1)) > 0).nonzero().flatten().tolist():
        places = [
            f"{kind} on ranks {(flags[:, column, index] > 0).nonzero().flatten().tolist()}"
            for column, kind in ((0, "masters"), (1, "weights"))
            if flags[:, column, index].any()
        ]
        found.append(f"{names[index]!r} ({'; '.join(places)})")
    return ", ".join(found[:8]) + (f" and {len(found) - 8} more" if len(found) > 8 else "")


class StepVerdict:
    """The step's global facts (see the module docstring)."""

    def __init__(self, squares: Tensor, used: tuple[bool, ...]):
        self.norm = squares[0].sqrt()  # 0-dim fp32 on the device: the global 2-norm (Inf/NaN if non-finite)
        self.nonfinite_flag = (~torch.isfinite(squares[0])).float()  # 0-dim fp32 on the device
        self.used = used  # per trained parameter: it received a gradient on some rank
        self._finite: bool | None = None

    @property
    def finite(self) -> bool:
        """Every gradient element on every rank is finite. Reading it synchronises with the GPU."""
        if self._finite is None:
            self._finite = not bool(self.nonfinite_flag.item())
        return self._finite


def local_squares(grad_shards: list[Tensor]) -> Tensor:
    """[1] fp32 on the shards' device: this rank's sum of squared gradient elements.

    One multi-tensor norm over the shards (one read of each, a launch or two), then the squares
    of those norms summed in bucket order, so that whoever asks (the verdict or a later clip) gets
    the same norm bit for bit. (A pow and a sum per shard cost three passes and three launches a
    bucket: host launches the GPU waited for between backward's end and the optimizer step.)"""
    norms = torch._foreach_norm(grad_shards)
    return torch.stack(norms).square().sum().reshape(1)


class PendingSum:
    """An all-reduce in flight (`start_sum`): `finish()` waits for it and gives the summed tensor."""

    def __init__(self, tensor: Tensor, work: Any):
        self._tensor, self._work = tensor, work

    def finish(self) -> Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._tensor


def start_sum(tensor: Tensor, group: Any) -> PendingSum:
    """Start summing `tensor` over `group` in place, asynchronously, so that a simulated job can
    start every rank's sum before it waits for any (`simulation.groups`). Collective."""
    return PendingSum(tensor, comm.all_reduce(tensor, group=group, async_op=True))


class PendingVerdict:
    """The verdict's two sums in flight (`start_verdict`); `finish()` waits and decides."""

    def __init__(self, squares: PendingSum, counts: PendingSum):
        self._squares, self._counts = squares, counts

    def finish(self) -> StepVerdict:
        squares, counts = self._squares.finish(), self._counts.finish()
        return StepVerdict(squares, tuple(bool(count) for count in counts.tolist()))


def start_verdict(grad_shards: list[Tensor], used_here: list[bool], group: Any, host_group: Any) -> PendingVerdict:
    """Start the sums the verdict needs: the squared gradient elements over `group` (on the
    gradients' device) and the used bitmap over `host_group` (CPU tensors). Collective."""
    counts = torch.tensor(used_here, dtype=torch.int32)
    return PendingVerdict(start_sum(local_squares(grad_shards), group), start_sum(counts, host_group))


def clip_coefficient(norm: Tensor, max_norm: float) -> Tensor:
    """What clipping by the global norm multiplies every gradient by: as torch.nn.utils.clip_grad_norm_,
    max_norm / (norm + 1e-6), capped at 1 (0-dim, on the norm's device; no host synchronisation)."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def apply_verdict(
    verdict: StepVerdict,
    mode: NonFinite,
    optimizers: list[torch.optim.Optimizer],
    fragments: Iterable[Any],
    skipped: SkippedSteps,
    step: int,
) -> bool:
    """Arm one rank's optimizers for the step the verdict decided; returns whether the host skips it.

    A parameter that got no gradient on any rank (and every one, on a host-skipped step) has its
    fragments' .grad (`fragments`: `engine.MasterFragment`s) set to None, so that the optimizer
    leaves it alone, as under DDP. With nonfinite="skip" and only fused optimizers the skip
    happens on the device (their `found_inf`, as under GradScaler: no host synchronisation);
    otherwise the host reads the verdict. Raises NonFiniteGradientError with nonfinite="error".
    """
    on_device = mode is NonFinite.SKIP and all(_skips_on_device(opt) for opt in optimizers)
    for optimizer in optimizers:
        # grad_scale None: nothing to unscale.
        # Attributes torch's fused optimizers read in step() (GradScaler sets them the same way).
        optimizer.grad_scale = None  # type: ignore[attr-defined]
        optimizer.found_inf = verdict.nonfinite_flag if on_device else None  # type: ignore[attr-defined]
    skip_on_host = False
    if (mode is NonFinite.ERROR or (mode is NonFinite.SKIP and not on_device)) and not verdict.finite:
        if mode is NonFinite.ERROR:
            raise NonFiniteGradientError(
                f"sdp4bit: a gradient is Inf or NaN at optimizer step {step} (on every rank's view of the "
                "global norm). Set SDP4BitConfig.nonfinite='skip' to skip such steps, or find the batch or "
                "layer that overflows."
            )
        skipped.host_skip(step)
        skip_on_host = True
    if on_device:
        skipped.device_skip(verdict.nonfinite_flag)
    for record in fragments:
        if skip_on_host or not verdict.used[record.param_index]:
            record.master.grad = None
    return skip_on_host


def unfrozen_since_start(module: nn.Module, frozen_names: list[str]) -> list[str]:
    """Which of `frozen_names` (the parameters frozen when the engine was built) now require grad.

    Runs before every backward, so it looks up those names only (none, mostly) instead of walking
    every parameter (1.5 ms a step on a 2-core CPU at 293 parameters); a name that no longer
    resolves to a parameter is not one that trains."""
    unfrozen = []
    for name in frozen_names:
        try:
            if module.get_parameter(name).requires_grad:
                unfrozen.append(name)
        except AttributeError:
            continue
    return unfrozen


def _skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step` honours `found_inf` on the device (torch's fused optimizers)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))
