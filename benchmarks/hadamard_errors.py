"""What the 32-point Hadamard rotation does to one step's real gradients, measured per parameter
group with the package's reference ops (the executable spec) and the tlq / tlq_hs presets'
settings (benchmarks/hadamard_diagnostic.py drives it).

Input, one bucket at a time: every rank's gradient `grads` fp32 [W, N] (each already divided by
W, as the engine's encode scales it; rank = node * L + local), and `labels` int64 [N], each
element's parameter group (an index into `groups`; len(groups) for the bucket's padding).

What `measure_bucket` adds to a `Tally` (relative errors are ||error|| / ||reference|| over a
parameter group's elements, summed in fp64):
- **the inter-node int4 stage alone**, without and with the rotation: its input is each node's
  exact sum of its L ranks' gradients (fp32, peers in order, as stage 2 sums them), quantized at
  the presets' inter-node bits and group size with stochastic rounding, dequantized and rotated
  back; the reference is those node sums. The int8 stage before it is left out, so the two differ
  in the rotation alone;
- **the two-level path end to end**, TLq and TLq-HS (`simulate_two_level_reduce_scatter` with the
  presets' settings and the engine's seeds for this step and bucket) against **the exact mean**,
  the fp64 sum of the W gradients;
- **the batch's own sampling noise**, the standard error of that mean over the ranks' windows,
  sqrt(sum_r ||W g_r - mean||^2 / (W (W - 1))), relative to the mean: stochastic rounding is
  unbiased, so its error adds to this noise as more noise of the same kind would;
- **the same errors as Adam sees them** (under "adam", when `measure_bucket` is given Adam's
  per-element preconditioner 1 / (sqrt(v) + eps)): every error and reference weighted by it
  before the norms. Adam divides each element's update by the RMS of its recent gradients, so
  an element with a small gradient moves as far as one with a large one, and noise moved onto
  it (which the rotation does: it spreads a block's quantization noise evenly over its 32
  elements) costs as much as noise on a large one; the plain norms, dominated by the largest
  elements, cannot see that;
- **the shape of each quantization group** (what sets its absmax scale): max/RMS and kurtosis
  E[x^4] / E[x^2]^2 (moments about 0, as the quantizer is symmetric about 0: 3 for Gaussian
  values, 128 for one spike among zeros), of the ranks' gradients (the int8 stage's input) and of
  the node sums (the int4 stage's input), unrotated and rotated. A group counts in the parameter
  group of its first element; all-zero groups (padding) are left out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_sdp4bit import SDP4BitConfig
from lightning_sdp4bit.buffers import BucketLayout
from lightning_sdp4bit.reference import blockwise_hadamard, dequantize_groups, quantize_groups, uniform_noise
from lightning_sdp4bit.reference.ops import stage_seed
from lightning_sdp4bit.reference.simulate import simulate_two_level_reduce_scatter

__all__ = ["Runs", "Tally", "element_labels", "int4_round_trip", "measure_bucket", "node_sums", "two_level_mean"]

TLQ, TLQ_HS = SDP4BitConfig.preset("tlq"), SDP4BitConfig.preset("tlq_hs")
ROTATION = TLQ_HS.hadamard_size  # 32
QUANTILES = {"p50": 0.5, "p99": 0.99, "max": 1.0}
# Sums of squares a Tally keeps: the error and its reference.
SUMS = ("int4_plain", "int4_hadamard", "node_sums", "tlq", "tlq_hs", "mean", "spread")


def element_labels(layout: BucketLayout, group_of: Callable[[str], int], padding: int, device) -> Tensor:
    """int64 [N]: the parameter group of each element of the bucket, `padding` where no parameter lies."""
    labels = torch.full((layout.numel,), padding, dtype=torch.int64, device=device)
    for slot in layout.slots:
        labels[slot.start : slot.start + slot.numel] = group_of(slot.name)
    return labels


@dataclass(frozen=True)
class Runs:
    """A bucket's labels as runs of equal labels (a parameter's elements are contiguous), so that a
    group's sum is a difference of prefix sums: an index_add_ of 10^8 elements into six groups
    would serialise on the GPU's atomics."""

    bounds: Tensor  # int64 [K + 1]: run k is elements bounds[k] .. bounds[k + 1] - 1
    labels: Tensor  # int64 [K]

    @classmethod
    def of(cls, labels: Tensor) -> Runs:
        starts = torch.nonzero(labels[1:] != labels[:-1]).flatten() + 1
        ends = torch.tensor([labels.numel()], device=labels.device)
        bounds = torch.cat([torch.zeros_like(ends), starts, ends])
        return cls(bounds, labels[bounds[:-1]])

    def sums(self, values: Tensor) -> Tensor:
        """fp64 [K]: the sum of `values` [N] over each run."""
        prefix = torch.cat([values.new_zeros(1, dtype=torch.float64), values.double().cumsum(0)])
        return prefix[self.bounds[1:]] - prefix[self.bounds[:-1]]


def node_sums(grads: Tensor, ranks_per_node: int) -> Tensor:
    """fp32 [M, N]: each node's sum of its ranks' gradients [W, N], in peer order."""
    by_node = grads.view(-1, ranks_per_node, grads.shape[1])
    total = by_node[:, 0].clone()
    for peer in range(1, ranks_per_node):
        total += by_node[:, peer]
    return total


def int4_round_trip(x: Tensor, hadamard_size: int, seed: int, config: SDP4BitConfig = TLQ_HS) -> Tensor:
    """fp32 x [N] through the inter-node stage's quantizer alone: rotated (hadamard_size 32) or not
    (0), quantized at config.grad_inter_bits in groups of config.grad_group_size with stochastic
    rounding, dequantized, rotated back."""
    rotated = blockwise_hadamard(x, hadamard_size) if hadamard_size else x
    groups = rotated.reshape(-1, config.grad_group_size)
    noise = uniform_noise(x.numel(), seed, x.device)
    codes, scales = quantize_groups(groups, config.grad_inter_bits, "stochastic", noise)
    values = dequantize_groups(codes, scales).view(-1)
    return blockwise_hadamard(values, hadamard_size) if hadamard_size else values  # the inverse is the transform


def two_level_mean(grads: Tensor, ranks_per_node: int, config: SDP4BitConfig, step: int, bucket: int) -> Tensor:
    """fp32 [N]: the averaged bucket gradient the two-level reduce-scatter under `config` gives
    (every rank's shard, in rank order), with the engine's seeds for this step and bucket."""
    shards = simulate_two_level_reduce_scatter(
        list(grads),
        ranks_per_node,
        intra_bits=config.grad_intra_bits,
        inter_bits=config.grad_inter_bits,
        group_size=config.grad_group_size,
        hadamard_size=config.hadamard_size,
        rounding=config.rounding,
        seed_fn=lambda rank, stage: stage_seed(config.seed, step, bucket, rank, stage),
    )
    return torch.cat(shards)


def group_shape(x: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """(max/RMS, kurtosis), fp32 [x.numel() / group_size] each, of x's consecutive groups; NaN for
    an all-zero group."""
    groups = x.reshape(-1, group_size).float()
    # Scaled to absmax 1 first: the statistics do not change, and x^4 of a gradient divided by
    # W (1e-10 is common) would underflow fp32.
    unit = groups / groups.abs().amax(dim=1, keepdim=True)  # 0 / 0 = NaN where the group is all zeros
    m2 = unit.square().mean(dim=1)
    return m2.rsqrt(), unit.pow(4).mean(dim=1) / m2.square()


@dataclass
class Tally:
    """What `measure_bucket` gathers over a step's buckets, per parameter group."""

    groups: list[str]
    sums: dict[str, Tensor] = field(default_factory=dict)  # SUMS name -> fp64 [len(groups) + 1]
    shapes: dict[str, list[tuple[Tensor, Tensor]]] = field(default_factory=dict)  # name -> (labels, values)
    elements: Tensor | None = None  # int64 [len(groups) + 1]
    world: int = 0  # W, the ranks whose gradients are measured

    def add_squares(self, name: str, runs: Runs, values: Tensor) -> None:
        """Add the squares of `values` [N] (squared in fp64: no underflow) to their groups' sums."""
        into = self.sums.setdefault(name, torch.zeros(len(self.groups) + 1, dtype=torch.float64, device=values.device))
        into.index_add_(0, runs.labels, runs.sums(values.double().square()))

    def add_shape(self, name: str, labels: Tensor, values: Tensor) -> None:
        self.shapes.setdefault(name, []).append((labels, values))

    def summary(self) -> dict:
        """{group or "all": {"elements", "grad_share", "int4_error": {"plain", "hadamard"},
        "two_level_error": {"tlq", "tlq_hs"}, "batch_noise", "shape": {name: {p50, p99, max}},
        and, where measured, "adam": the three errors again as Adam sees them}}."""
        assert self.elements is not None, "no bucket measured"
        sums = {name: [*values[:-1].tolist(), values[:-1].sum().item()] for name, values in self.sums.items()}
        out = {}
        for index, group in enumerate([*self.groups, "all"]):
            out[group] = {
                "elements": int(self.elements[:-1].sum() if group == "all" else self.elements[index]),
                "grad_share": sums["mean"][index] / sums["mean"][-1],
                **self._errors(sums, index, ""),
                "shape": {name: self._quantiles(name, None if group == "all" else index) for name in self.shapes},
            }
            if "mean_adam" in sums:
                out[group]["adam"] = self._errors(sums, index, "_adam")
        return out

    def _errors(self, sums: dict[str, list[float]], index: int, suffix: str) -> dict:
        def ratio(error: str, reference: str) -> float:
            error, reference = sums[error + suffix][index], sums[reference + suffix][index]
            return (error / reference) ** 0.5 if reference > 0 else float("nan")

        return {
            "int4_error": {"plain": ratio("int4_plain", "node_sums"), "hadamard": ratio("int4_hadamard", "node_sums")},
            "two_level_error": {"tlq": ratio("tlq", "mean"), "tlq_hs": ratio("tlq_hs", "mean")},
            "batch_noise": ratio("spread", "mean") / (self.world * (self.world - 1)) ** 0.5,
        }

    def _quantiles(self, name: str, label: int | None) -> dict[str, float]:
        values = torch.cat([v if label is None else v[labels == label] for labels, v in self.shapes[name]])
        values = values[~values.isnan()].sort().values
        if values.numel() == 0:
            return dict.fromkeys(QUANTILES, float("nan"))
        last = values.numel() - 1
        return {key: values[round(q * last)].item() for key, q in QUANTILES.items()}


def measure_bucket(
    grads: Tensor, labels: Tensor, ranks_per_node: int, step: int, bucket: int, tally: Tally, adam: Tensor | None = None
) -> None:
    """Add one bucket's measurements (the module docstring's list) to `tally`. grads fp32 [W, N],
    labels int64 [N], adam: fp32 [N], Adam's preconditioner 1 / (sqrt(v) + eps) per element, 0
    where no parameter lies (or None: no "adam" errors)."""
    group = TLQ_HS.grad_group_size
    runs = Runs.of(labels)

    def add(name: str, values: Tensor) -> None:
        tally.add_squares(name, runs, values)
        if adam is not None:
            tally.add_squares(f"{name}_adam", runs, values.double() * adam)

    count = torch.zeros(len(tally.groups) + 1, dtype=torch.int64, device=labels.device)
    count.index_add_(0, runs.labels, runs.bounds.diff())
    tally.elements = count if tally.elements is None else tally.elements + count
    exact = torch.zeros(grads.shape[1], dtype=torch.float64, device=grads.device)
    for rank_grad in grads:
        exact += rank_grad
    add("mean", exact)
    tally.world = grads.shape[0]
    for rank_grad in grads:  # W g_r: the gradient of rank r's window alone
        add("spread", rank_grad.double() * tally.world - exact)
    for name, config in (("tlq", TLQ), ("tlq_hs", TLQ_HS)):
        estimate = two_level_mean(grads, ranks_per_node, config, step, bucket)
        add(name, estimate.double() - exact)
    del exact
    group_labels = labels[::group].expand(ranks_per_node, -1).reshape(-1)  # [L * N / g]: one node's ranks
    for node, total in enumerate(node_sums(grads, ranks_per_node)):
        add("node_sums", total)
        seed = stage_seed(TLQ_HS.seed, step, bucket, node)  # the same draws with and without the rotation
        for name, size in (("int4_plain", 0), ("int4_hadamard", ROTATION)):
            add(name, int4_round_trip(total, size, seed) - total)
        for suffix, x in (("", total), ("_rotated", blockwise_hadamard(total, ROTATION))):
            crest, kurtosis = group_shape(x, group)
            tally.add_shape(f"node_crest{suffix}", labels[::group], crest)
            tally.add_shape(f"node_kurtosis{suffix}", labels[::group], kurtosis)
        peers = grads[node * ranks_per_node : (node + 1) * ranks_per_node]
        for suffix, x in (("", peers), ("_rotated", blockwise_hadamard(peers, ROTATION))):
            crest, kurtosis = group_shape(x, group)
            tally.add_shape(f"rank_crest{suffix}", group_labels, crest)
            tally.add_shape(f"rank_kurtosis{suffix}", group_labels, kurtosis)
