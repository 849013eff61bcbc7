"""Configuration of the SDP4Bit strategy: one frozen dataclass, its presets and its loaders.

`SDP4BitConfig` is the single source of truth. Dicts, omegaconf DictConfigs, YAML files and
dotlist overrides (``["grad_inter_bits=8"]``) are all turned into it by the loaders below, so
there is one set of checks, run in ``__post_init__``. Checks that need the world size run in
`SDP4BitConfig.resolve_ranks_per_node`, which the strategy calls before any collective.

This module imports neither torch nor omegaconf at import time, so that importing the package
stays quick.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "GradQuant",
    "NonFinite",
    "Rounding",
    "SDP4BitConfig",
    "WeightQuant",
    "WeightSharding",
    "PRESETS",
    "auto_bucket_numel",
    "load_yaml",
]


class WeightQuant(str, Enum):
    """How the weight all-gather after the optimizer step is compressed."""

    DIFF = "diff"  # qWD: quantize master - weights every rank already holds (the paper's method)
    DIRECT = "direct"  # qW: quantize the new weights themselves (the ablation; ZeRO++'s qwZ)
    NONE = "none"  # all-gather the weights uncompressed, in the weights' dtype


class GradQuant(str, Enum):
    """How the gradient reduce-scatter is compressed."""

    TWO_LEVEL = "two_level"  # TLq(-HS): int-intra all-to-all, then int-inter all-to-all
    NONE = "none"  # reduce-scatter in fp32, uncompressed


class Rounding(str, Enum):
    """How real values are rounded to quantization levels."""

    STOCHASTIC = "stochastic"  # floor(v + u), u ~ U[0, 1): unbiased, what the paper uses
    NEAREST = "nearest"  # round half to even: deterministic, used by the bit-exact tests


class NonFinite(str, Enum):
    """What a step does when a gradient element is Inf or NaN on any rank (decided on all ranks alike)."""

    SKIP = "skip"  # no optimizer step, no weight exchange; masters and optimizer state kept; counted
    ERROR = "error"  # raise NonFiniteGradientError on every rank, naming the step
    # step anyway: uncompressed, the weights DDP would poison become non-finite; compressed, each
    # poisoned element's whole weight group (with clipping, every weight)
    PROPAGATE = "propagate"


class WeightSharding(str, Enum):
    """Where the model weights (in the module's dtype) live between the forwards that use them."""

    REPLICATED = "replicated"  # every rank holds all of them (ZeRO-1, as the paper's Megatron code)
    NODE = "node"  # each rank holds 1/L, its node's share: a layer's are gathered inside the node for its use


ALLOWED_BITS = (2, 4, 8)

# Automatic bucket size: about this many buckets, each within these bounds (elements). Several
# buckets let the first reduce-scatters start while backward still runs and the first layers'
# weights land before the rest; the bounds keep the per-bucket host work (a few kernel launches
# and collectives) small next to the bucket's own transfer.
AUTO_BUCKETS = 8
AUTO_BUCKET_BOUNDS = (1_000_000, 25_000_000)


# node_gather_prefetch=None: two gathers ahead hide a 6.7B layer's (0.28 GiB over NVLink) under
# 100 Gb/s links, where one ahead left 6% of the step exposed (docs/guide/large-models.md).
_NODE_GATHER_PREFETCH = 2


def auto_bucket_numel(trained_numel: int) -> int:
    """The `bucket_numel` used when the config leaves it None, for a model of `trained_numel` elements."""
    low, high = AUTO_BUCKET_BOUNDS
    return min(high, max(low, -(-trained_numel // AUTO_BUCKETS)))


def _is_power_of_two(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0 and value & (value - 1) == 0


def _check_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")


def check_bits(name: str, value: Any) -> None:
    """Raise a ValueError naming `name` unless `value` is a supported code width."""
    if isinstance(value, bool) or value not in ALLOWED_BITS:
        raise ValueError(f"{name} must be one of {', '.join(map(str, ALLOWED_BITS))}, got {value!r}")


def check_power_of_two(name: str, value: Any) -> None:
    """Raise a ValueError naming `name` unless `value` is a positive power of two."""
    if not _is_power_of_two(value):
        raise ValueError(f"{name} must be a positive power of two (1, 2, 4, ...), got {value!r}")


E = TypeVar("E", bound=Enum)


def coerce_enum(name: str, value: Any, enum_type: type[E]) -> E:
    """Turn a string (or the enum itself) into `enum_type`, or raise a ValueError naming `name`."""
    allowed = ", ".join(repr(member.value) for member in enum_type)
    try:
        return enum_type(value.value if isinstance(value, Enum) else value)
    except ValueError:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}") from None


@dataclass(frozen=True)
class SDP4BitConfig:
    """Everything that selects and tunes SDP4Bit's compression. Defaults are the paper's.

    Build it directly, from a preset (`SDP4BitConfig.preset("qwd")`), from a dict or DictConfig
    (`from_dict`), from YAML (`from_yaml`), and refine it with dotlist overrides
    (`with_overrides(["weight_bits=8"])`). Every invalid value raises a ValueError that names the
    field and what is allowed.
    """

    weight_quant: WeightQuant = WeightQuant.DIFF
    """Weight all-gather: "diff" (qWD), "direct" (qW, the ablation) or "none"."""

    weight_bits: int = 4
    """Code width of the weight all-gather: 2, 4 or 8 bits. Levels are -(2^(b-1)-1)..2^(b-1)-1."""

    weight_group_size: int = 2048
    """Elements per fp32 scale in the weight all-gather (a power of two). 2048 costs 32/2048 bits."""

    grad_quant: GradQuant = GradQuant.TWO_LEVEL
    """Gradient reduce-scatter: "two_level" (two quantized all-to-alls) or "none" (fp32)."""

    grad_intra_bits: int = 8
    """Code width of the intra-node gradient all-to-all: 2, 4 or 8 bits."""

    grad_inter_bits: int = 4
    """Code width of the inter-node gradient all-to-all: 2, 4 or 8 bits."""

    grad_group_size: int = 128
    """Elements per fp32 scale at both gradient stages (a power of two, a multiple of hadamard_size)."""

    hadamard_size: int = 32
    """Block of the Walsh-Hadamard transform applied to gradients before quantizing; 0 turns it off."""

    rounding: Rounding = Rounding.STOCHASTIC
    """"stochastic" (unbiased; the paper's choice) or "nearest" (deterministic)."""

    ranks_per_node: int | None = None
    """Ranks that share a node for the two-level all-to-all. None takes LOCAL_WORLD_SIZE; an int
    emulates several nodes on one host (4 processes with 2 per node = 2 virtual nodes)."""

    bucket_numel: int | None = None
    """Target elements per gradient/weight bucket. Larger buckets mean fewer, bigger collectives;
    smaller ones start communicating earlier in backward. A parameter never spans two buckets.
    None (default): the trained elements / 8, kept within 1M-25M (`auto_bucket_numel`)."""

    first_bucket_numel: int = 1_000_000
    """Target elements of the first bucket (the last layers, whose gradients are ready first),
    capped at bucket_numel: a small first bucket starts communicating early, as DDP's 1 MB one."""

    min_compress_numel: int = 0
    """Buckets with fewer elements than this travel uncompressed. 0 (default) compresses all; the
    strategy logs which buckets it leaves out, so nothing falls back silently."""

    seed: int = 0
    """Base seed of stochastic rounding; each rank, step, bucket and stage derives its own."""

    log_comm_stats: bool = True
    """Log the per-step communication figures (bytes, bits per element) through the Trainer, on
    the steps it writes logs (every `log_every_n_steps`)."""

    nonfinite: NonFinite = NonFinite.SKIP
    """An Inf or NaN gradient on any rank: "skip" the step (default; counted in
    comm/nonfinite_steps and warned about), "error" (raise on every rank) or "propagate" (step
    anyway; the user guide's "Non-finite gradients" says which weights turn non-finite). Every rank takes
    the same decision."""

    nonfinite_skip_limit: int = 20
    """With nonfinite="skip": after this many optimizer steps skipped in a row, every rank stops
    with NonFiniteGradientError (0: never). A transient overflow passes within a few steps; a run
    that skips on and on is not training. Whatever the limit, a skipped step after which the
    masters or weights hold Inf or NaN (a hook wrote them) stops every rank at once."""

    broadcast_buffers: bool = True
    """Before a forward, every rank takes rank 0's module buffers (BatchNorm's running statistics,
    any registered buffer), on DDP's schedule, as DDP's `broadcast_buffers=True` (its default);
    false: each rank keeps its own, as DDP's `broadcast_buffers=False`."""

    weight_sharding: WeightSharding = WeightSharding.REPLICATED
    """"replicated": every rank holds the full weights in the module's dtype. "node": each rank
    holds its node's 1/L of them (L ranks per node, at least 2); a module's weights are gathered
    inside the node, losslessly, before its forward and again before its backward, and released
    after each. The numerics are the same bit for bit; the guide's "Models that do not fit
    replicated" says what it costs and what it refuses."""

    node_gather_prefetch: int | None = None
    """With weight_sharding="node": how many buckets' gathers start ahead of the one a module
    waits for (None: 2; 0: none). Each one more hides more NVLink time behind compute and holds
    one more bucket's full weights at the peak: at 6.7B on 16 x 4 nodes at 100 Gb/s, 1 lowers
    the peak by 0.21 GiB and lengthens the step by 6%."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "weight_quant", coerce_enum("weight_quant", self.weight_quant, WeightQuant))
        object.__setattr__(self, "grad_quant", coerce_enum("grad_quant", self.grad_quant, GradQuant))
        object.__setattr__(self, "rounding", coerce_enum("rounding", self.rounding, Rounding))
        check_bits("weight_bits", self.weight_bits)
        check_bits("grad_intra_bits", self.grad_intra_bits)
        check_bits("grad_inter_bits", self.grad_inter_bits)
        check_power_of_two("weight_group_size", self.weight_group_size)
        check_power_of_two("grad_group_size", self.grad_group_size)
        _check_int("hadamard_size", self.hadamard_size)
        if self.hadamard_size != 0:
            if not _is_power_of_two(self.hadamard_size) or self.hadamard_size > self.grad_group_size:
                raise ValueError(
                    "hadamard_size must be 0 (off) or a power of two that divides grad_group_size "
                    f"({self.grad_group_size}), got {self.hadamard_size!r}"
                )
        if self.ranks_per_node is not None:
            _check_int("ranks_per_node", self.ranks_per_node)
            if self.ranks_per_node < 1:
                raise ValueError(f"ranks_per_node must be None or a positive integer, got {self.ranks_per_node!r}")
        object.__setattr__(self, "nonfinite", coerce_enum("nonfinite", self.nonfinite, NonFinite))
        sharding = coerce_enum("weight_sharding", self.weight_sharding, WeightSharding)
        object.__setattr__(self, "weight_sharding", sharding)
        if self.node_gather_prefetch is not None:
            _check_int("node_gather_prefetch", self.node_gather_prefetch)
            if self.node_gather_prefetch < 0:
                raise ValueError(
                    f"node_gather_prefetch must be None (2) or an integer >= 0, got {self.node_gather_prefetch!r}"
                )
            if sharding is not WeightSharding.NODE:
                raise ValueError(
                    f"node_gather_prefetch={self.node_gather_prefetch} needs weight_sharding='node', got "
                    f"weight_sharding='{sharding.value}': the replicated mode gathers nothing inside the node"
                )
        if self.bucket_numel is not None:
            _check_int("bucket_numel", self.bucket_numel)
            if self.bucket_numel < 1:
                raise ValueError(
                    f"bucket_numel must be None (automatic) or a positive integer, got {self.bucket_numel!r}"
                )
        _check_int("first_bucket_numel", self.first_bucket_numel)
        if self.first_bucket_numel < 1:
            raise ValueError(f"first_bucket_numel must be a positive integer, got {self.first_bucket_numel!r}")
        _check_int("min_compress_numel", self.min_compress_numel)
        if self.min_compress_numel < 0:
            raise ValueError(f"min_compress_numel must be >= 0, got {self.min_compress_numel!r}")
        _check_int("seed", self.seed)
        _check_int("nonfinite_skip_limit", self.nonfinite_skip_limit)
        if self.nonfinite_skip_limit < 0:
            raise ValueError(f"nonfinite_skip_limit must be >= 0 (0: no limit), got {self.nonfinite_skip_limit!r}")
        if not isinstance(self.log_comm_stats, bool):
            raise ValueError(f"log_comm_stats must be true or false, got {self.log_comm_stats!r}")
        if not isinstance(self.broadcast_buffers, bool):
            raise ValueError(f"broadcast_buffers must be true or false, got {self.broadcast_buffers!r}")

    # ----------------------------------------------------------------------------------------
    # Derived properties

    @property
    def compresses_weights(self) -> bool:
        return self.weight_quant is not WeightQuant.NONE

    @property
    def compresses_grads(self) -> bool:
        return self.grad_quant is not GradQuant.NONE

    @property
    def shards_weights(self) -> bool:
        return self.weight_sharding is WeightSharding.NODE

    @property
    def gathers_ahead(self) -> int:
        """Buckets whose node gathers start ahead of the one a module waits for."""
        return _NODE_GATHER_PREFETCH if self.node_gather_prefetch is None else self.node_gather_prefetch

    def resolve_ranks_per_node(self, world_size: int, local_world_size: int | None = None) -> int:
        """The node size for the two-level all-to-all, checked against `world_size`.

        `local_world_size` is the launcher's ranks per host (LOCAL_WORLD_SIZE); it is used when
        `ranks_per_node` is None. Raises a ValueError when the result does not divide the world,
        or is 1 with the weights sharded inside the node.
        """
        if self.ranks_per_node is not None:
            ranks_per_node, source = self.ranks_per_node, "ranks_per_node"
        else:
            env = os.environ.get("LOCAL_WORLD_SIZE")
            ranks_per_node = local_world_size if local_world_size is not None else int(env) if env else world_size
            source = "ranks_per_node (taken from LOCAL_WORLD_SIZE)"
        if ranks_per_node < 1 or world_size % ranks_per_node != 0:
            raise ValueError(
                f"{source}={ranks_per_node} must divide the world size {world_size}: every node needs "
                "the same number of ranks for the two-level all-to-all"
            )
        if self.shards_weights and ranks_per_node == 1:
            raise ValueError(
                f"weight_sharding='node' needs at least 2 ranks per node, got {source}={ranks_per_node}: with one "
                "rank per node each rank would hold the whole model anyway (use weight_sharding='replicated')"
            )
        return ranks_per_node

    # ----------------------------------------------------------------------------------------
    # Loaders

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> SDP4BitConfig:
        """The paper's ablations by name (see `PRESETS`), with optional field overrides."""
        if name not in PRESETS:
            raise ValueError(f"preset must be one of {', '.join(map(repr, PRESETS))}, got {name!r}")
        return cls.from_dict({**PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SDP4BitConfig:
        """Build from a mapping (a dict or an omegaconf DictConfig).

        A ``preset`` key starts from that preset; the other keys then override it.
        """
        values = _to_plain_dict(values)
        preset = values.pop("preset", None)
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise ValueError(
                f"unknown SDP4BitConfig field(s) {', '.join(map(repr, unknown))}; "
                f"allowed: preset, {', '.join(cls.field_names())}"
            )
        if preset is not None:
            return cls.preset(preset, **values)
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: Iterable[str] = ()) -> SDP4BitConfig:
        """Load a YAML file of fields (optionally with ``preset: name``), then apply dotlist overrides."""
        from omegaconf import OmegaConf

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config path {str(path)!r} is not a file")
        merged = OmegaConf.merge(load_yaml(path), _from_dotlist(overrides))
        return cls.from_dict(_to_plain_dict(merged))

    def with_overrides(self, overrides: Iterable[str]) -> SDP4BitConfig:
        """A copy with dotlist overrides applied, e.g. ``["grad_inter_bits=8", "rounding=nearest"]``.

        ``preset=name`` restarts from that preset before the other overrides.
        """
        parsed = _to_plain_dict(_from_dotlist(overrides))
        if "preset" in parsed:
            return SDP4BitConfig.from_dict(parsed)
        return SDP4BitConfig.from_dict({**self.to_dict(), **parsed})

    @classmethod
    def coerce(cls, config: SDP4BitConfig | Mapping[str, Any] | str | os.PathLike | None) -> SDP4BitConfig:
        """Accept whatever a user may pass as ``config=``: a config, a mapping, a YAML path or None."""
        if config is None:
            return cls()
        if isinstance(config, SDP4BitConfig):
            return config
        if isinstance(config, (str, os.PathLike)):
            return cls.from_yaml(config)
        if isinstance(config, Mapping) or type(config).__name__ == "DictConfig":
            return cls.from_dict(config)
        raise ValueError(
            "config must be an SDP4BitConfig, a dict, an omegaconf DictConfig or a YAML path, "
            f"got {type(config).__name__}"
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values (enums as their strings), ready for YAML or logging."""
        return {
            name: value.value if isinstance(value, Enum) else value
            for name, value in ((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))
        }

    def to_yaml(self, path: str | os.PathLike | None = None) -> str:
        """The config as YAML text; also written to `path` when one is given."""
        from omegaconf import OmegaConf

        text = OmegaConf.to_yaml(OmegaConf.create(self.to_dict()))
        if path is not None:
            Path(path).write_text(text)
        return text


def load_yaml(path: str | os.PathLike) -> Any:
    """`OmegaConf.load(path)`, with broken YAML syntax reported as a ValueError that names the
    file, the line and the column (1-based), e.g. ``cfg.yaml:3:2: invalid YAML: did not find
    expected ',' or ']' (while parsing a flow sequence that starts at line 2, column 4)``,
    instead of yaml's ScannerError or ParserError."""
    import yaml
    from omegaconf import OmegaConf

    try:
        return OmegaConf.load(Path(path))  # it opens str and Path; another os.PathLike it would .read()
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = error.problem or error.context or "unreadable"
        context = ""
        if error.context and error.problem and error.context_mark is not None:
            start = error.context_mark
            context = f" ({error.context} that starts at line {start.line + 1}, column {start.column + 1})"
        raise ValueError(f"{where}: invalid YAML: {problem}{context}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: invalid YAML: {error}") from None


def _from_dotlist(overrides: Iterable[str]) -> Any:
    """omegaconf's DictConfig of ``key=value`` items. omegaconf reads a bare ``key`` as key=None,
    which for ranks_per_node or bucket_numel would silently mean "automatic": refused instead."""
    from omegaconf import OmegaConf

    overrides = list(overrides)
    for item in overrides:
        key, sign, _ = str(item).partition("=")
        if not sign or not key.strip():
            raise ValueError(f"override {item!r}: expected key=value, e.g. 'grad_inter_bits=8'")
    return OmegaConf.from_dotlist(overrides)


def _to_plain_dict(values: Any) -> dict[str, Any]:
    """A dict of the mapping's items; a DictConfig is resolved into plain containers first."""
    if type(values).__name__ == "DictConfig":
        from omegaconf import OmegaConf

        values = OmegaConf.to_container(values, resolve=True)
    if not isinstance(values, Mapping):
        raise ValueError(f"expected a mapping of SDP4BitConfig fields, got {type(values).__name__}")
    return dict(values)


_NO_GRAD_QUANT = {"grad_quant": "none"}
_NO_WEIGHT_QUANT = {"weight_quant": "none"}

PRESETS: dict[str, dict[str, Any]] = {
    # Table 1 of the paper, one column each. Fields not named keep their defaults.
    "baseline": {**_NO_WEIGHT_QUANT, **_NO_GRAD_QUANT},
    "qw": {"weight_quant": "direct", **_NO_GRAD_QUANT},
    "qwd": {"weight_quant": "diff", **_NO_GRAD_QUANT},
    "ulq": {**_NO_WEIGHT_QUANT, "grad_intra_bits": 4, "grad_inter_bits": 4, "hadamard_size": 0},
    "tlq": {**_NO_WEIGHT_QUANT, "grad_intra_bits": 8, "grad_inter_bits": 4, "hadamard_size": 0},
    "tlq_hs": {**_NO_WEIGHT_QUANT, "grad_intra_bits": 8, "grad_inter_bits": 4, "hadamard_size": 32},
    "sdp4bit": {},
}
"""Named ablations. "sdp4bit" is qWD + TLq-HS, i.e. the defaults."""
