"""lightning-sdp4bit: sharded data parallelism for PyTorch Lightning that communicates in ~4 bits.

    import lightning_sdp4bit                     # registers the "sdp4bit" strategy name
    trainer = Trainer(strategy="sdp4bit")        # qWD weights + TLq-HS gradients, paper defaults
    fabric = Fabric(strategy="sdp4bit")          # the same, for Lightning Fabric

Public API (each name is imported on first use, so `import lightning_sdp4bit` stays quick):
- `SDP4BitConfig`: the configuration dataclass and its presets;
- `quantize`, `dequantize`, `QuantizedTensor`: the reference group-wise quantizer;
- `SDP4BitStrategy`: the Trainer strategy (also reachable as `strategy="sdp4bit"`);
- `SDP4BitFabricStrategy`: the Fabric strategy (also reachable as `Fabric(strategy="sdp4bit")`);
- `SDP4BitSimulationStrategy`: a job of M x L ranks trained on one device, for the Trainer.
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning_sdp4bit._registration import install_registration_hook

# The one place the version is written: pyproject.toml reads it from here at build time.
__version__ = "0.1.0"

_LAZY = {
    "SDP4BitConfig": "lightning_sdp4bit.config",
    "PRESETS": "lightning_sdp4bit.config",
    "QuantizedTensor": "lightning_sdp4bit.reference.quantize",
    "quantize": "lightning_sdp4bit.reference.quantize",
    "dequantize": "lightning_sdp4bit.reference.quantize",
    "SDP4BitStrategy": "lightning_sdp4bit.strategies",
    "SDP4BitFabricStrategy": "lightning_sdp4bit.strategies",
    "SDP4BitSimulationStrategy": "lightning_sdp4bit.strategies",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lightning_sdp4bit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__


install_registration_hook()
