"""The example's settings: one YAML file, command-line overrides on top, all checked up front.

`load_config` merges examples/configs/gpt.yaml (or another file) and ``key=value`` overrides into
the dataclasses below with omegaconf, so an unknown key or a badly typed value fails at once, and
`check_config` checks what types cannot (ranges, divisibility, the sdp4bit block). Every problem
raises a `ConfigError` whose message starts with the offending key, before any process starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException

from lightning_sdp4bit import SDP4BitConfig
from lightning_sdp4bit.config import load_yaml
from lightning_sdp4bit.simulation import check_shape, parse_world

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "gpt.yaml"


class ConfigError(ValueError):
    """A bad setting; the message starts with its key, e.g. ``data.path: ... does not exist``."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key


# The sections of the YAML file. Defaults and comments live in the YAML file only (MISSING here),
# so there is one place to read them; a key left out of a user's YAML file is an error.


@dataclass
class ModelSettings:
    n_layer: int = MISSING
    n_head: int = MISSING
    n_embd: int = MISSING
    block_size: int = MISSING
    vocab_size: int | None = MISSING
    dropout: float = MISSING
    bias: bool = MISSING


@dataclass
class DataSettings:
    path: str | None = MISSING
    val_fraction: float = MISSING
    batch_size: int = MISSING
    val_batches: int = MISSING


@dataclass
class OptimSettings:
    lr: float = MISSING
    min_lr: float = MISSING
    warmup_steps: int = MISSING
    weight_decay: float = MISSING
    beta1: float = MISSING
    beta2: float = MISSING
    grad_clip: float = MISSING


@dataclass
class TrainerSettings:
    accelerator: str = MISSING
    devices: Any = MISSING
    precision: str = MISSING
    max_steps: int = MISSING
    val_every: int = MISSING
    accumulate_grad_batches: int = MISSING
    log_every: int = MISSING
    seed: int = MISSING
    out_dir: str = MISSING
    progress_bar: bool = MISSING
    sample_bytes: int = MISSING
    start_method: str = MISSING


@dataclass
class Settings:
    model: ModelSettings = field(default_factory=ModelSettings)
    data: DataSettings = field(default_factory=DataSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)
    trainer: TrainerSettings = field(default_factory=TrainerSettings)
    sdp4bit: dict[str, Any] = field(default_factory=dict)  # checked by SDP4BitConfig itself


PRECISIONS = ("auto", "32-true", "bf16-true", "bf16-mixed")
ACCELERATORS = ("auto", "cpu", "gpu", "cuda")


def load_config(overrides: list[str] = (), path: str | Path = DEFAULT_CONFIG) -> Settings:
    """The YAML file at `path` with dotlist `overrides` applied, as checked `Settings`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("--config", f"{str(path)!r} is not a file")
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(item, "expected key=value, e.g. trainer.max_steps=200")
    try:
        loaded = load_yaml(path)
    except ValueError as err:  # names the file, the line and the column
        raise ConfigError("--config", str(err)) from None
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Settings), loaded, OmegaConf.from_dotlist(overrides))
        settings: Settings = OmegaConf.to_object(merged)
    except ConfigKeyError as err:
        raise ConfigError(err.full_key, f"unknown key; {_allowed_keys(err.full_key)}") from None
    except MissingMandatoryValue as err:
        raise ConfigError(err.full_key, f"missing: {path} must set it") from None
    except OmegaConfBaseException as err:
        raise ConfigError(err.full_key or str(path), str(err.msg).splitlines()[0]) from None
    check_config(settings)
    return settings


def _allowed_keys(full_key: str) -> str:
    section = full_key.split(".")[0]
    sections = [f.name for f in dataclasses.fields(Settings)]
    if section in sections and "." in full_key:
        names = [f.name for f in dataclasses.fields(type(getattr(Settings(), section)))]
        return f"{section}.* takes {', '.join(names)}"
    return f"the sections are {', '.join(sections)}"


def sdp4bit_config(settings: Settings) -> SDP4BitConfig:
    """The SDP4BitConfig of the ``sdp4bit`` block. A null field means "as the preset has it"."""
    values = {key: value for key, value in settings.sdp4bit.items() if value is not None and key != "simulate"}
    allowed = ["preset", *SDP4BitConfig.field_names(), "simulate"]
    for key in values:
        if key not in allowed:
            raise ConfigError(f"sdp4bit.{key}", f"unknown key; sdp4bit.* takes {', '.join(allowed)}")
    try:
        return SDP4BitConfig.from_dict(values)
    except ValueError as err:  # its messages start with the field's name
        field_name, _, problem = str(err).partition(" ")
        key = f"sdp4bit.{field_name}" if field_name in allowed else "sdp4bit"
        raise ConfigError(key, problem if field_name in allowed else str(err)) from None


def _positive(key: str, value: Any) -> None:
    if value is None or value <= 0:
        raise ConfigError(key, f"must be positive, got {value!r}")


def check_config(s: Settings) -> None:
    """Checks that need more than one value or more than a type. Data files are checked in data.py."""
    m, d, o, t = s.model, s.data, s.optim, s.trainer
    for key in ("n_layer", "n_head", "n_embd", "block_size"):
        _positive(f"model.{key}", getattr(m, key))
    if m.n_embd % m.n_head:
        raise ConfigError("model.n_embd", f"{m.n_embd} must be divisible by model.n_head ({m.n_head})")
    if m.vocab_size is not None and not 1 <= m.vocab_size <= 65536:
        raise ConfigError("model.vocab_size", f"must be null or in 1..65536, got {m.vocab_size}")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError("model.dropout", f"must be in [0, 1), got {m.dropout}")
    if not 0.0 < d.val_fraction < 1.0:
        raise ConfigError("data.val_fraction", f"must be between 0 and 1, got {d.val_fraction}")
    _positive("data.batch_size", d.batch_size)
    _positive("data.val_batches", d.val_batches)
    _positive("optim.lr", o.lr)
    if not 0.0 <= o.min_lr <= o.lr:
        raise ConfigError("optim.min_lr", f"must be in [0, optim.lr={o.lr}], got {o.min_lr}")
    for key in ("warmup_steps", "weight_decay", "grad_clip"):
        if getattr(o, key) < 0:
            raise ConfigError(f"optim.{key}", f"must be >= 0, got {getattr(o, key)}")
    for key in ("beta1", "beta2"):
        if not 0.0 <= getattr(o, key) < 1.0:
            raise ConfigError(f"optim.{key}", f"must be in [0, 1), got {getattr(o, key)}")
    if t.accelerator not in ACCELERATORS:
        raise ConfigError("trainer.accelerator", f"must be one of {', '.join(ACCELERATORS)}, got {t.accelerator!r}")
    if t.devices != "auto" and (not isinstance(t.devices, int) or isinstance(t.devices, bool) or t.devices < 1):
        raise ConfigError("trainer.devices", f"must be a positive number of processes or 'auto', got {t.devices!r}")
    if t.precision not in PRECISIONS:
        raise ConfigError("trainer.precision", f"must be one of {', '.join(PRECISIONS)}, got {t.precision!r}")
    for key in ("max_steps", "val_every", "accumulate_grad_batches", "log_every"):
        _positive(f"trainer.{key}", getattr(t, key))
    if t.sample_bytes < 0:
        raise ConfigError("trainer.sample_bytes", f"must be >= 0, got {t.sample_bytes}")
    if t.start_method not in ("popen", "spawn"):
        raise ConfigError("trainer.start_method", f"must be 'popen' or 'spawn', got {t.start_method!r}")
    sdp4bit_config(s)  # raises on unknown fields or bad values


def simulated_world(s: Settings) -> tuple[int, int] | None:
    """sdp4bit.simulate ("MxL") as (M, L), or None to train with real processes."""
    spec = s.sdp4bit.get("simulate")
    if spec is None:
        return None
    if not isinstance(spec, str):  # YAML reads 0x4 as the hexadecimal number 4, 2 as a number
        raise ConfigError(
            "sdp4bit.simulate",
            f"expected 'MxL' (M nodes of L ranks each, e.g. 16x4), got the number {spec!r} (YAML reads a value "
            "such as 0x4 as a hexadecimal number); at least 1 node of 1 rank and 2 ranks in all",
        )
    try:
        return parse_world(spec)
    except ValueError as err:
        raise ConfigError("sdp4bit.simulate", str(err)) from None


def check_world(s: Settings, world_size: int) -> None:
    """Checks against the number of processes: nodes must divide it; a simulated job runs on one,
    in the shape of sdp4bit.simulate."""
    simulated = simulated_world(s)
    if simulated is not None:  # the simulation takes its shape from sdp4bit.simulate, on one device
        if world_size != 1:
            raise ConfigError(
                "trainer.devices",
                f"is {world_size}, but a simulated job (sdp4bit.simulate) runs every rank on one device: "
                "set it to 1 or auto",
            )
        try:
            check_shape(sdp4bit_config(s), *simulated)
        except ValueError as err:
            raise ConfigError("sdp4bit.ranks_per_node", str(err)) from None
        return
    try:
        sdp4bit_config(s).resolve_ranks_per_node(world_size, local_world_size=world_size)
    except ValueError as err:
        raise ConfigError("sdp4bit.ranks_per_node", str(err)) from None


def to_yaml(s: Settings) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(s))
