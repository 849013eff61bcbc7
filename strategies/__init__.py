"""Lightning strategies of lightning-sdp4bit, installed as `lightning_sdp4bit.strategies`.

- `SDP4BitStrategy`: for the Trainer (imports lightning.pytorch);
- `SDP4BitFabricStrategy`: for Fabric (imports lightning.fabric only);
- `SDP4BitSimulationStrategy`: a job of M x L ranks trained on one device, for the Trainer.

Each is imported on first use, so that a Fabric script does not pay for importing the Trainer.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "SUPPORTED_PRECISIONS": "lightning_sdp4bit.strategies.common",
    "SDP4BitStrategy": "lightning_sdp4bit.strategies.sdp4bit",
    "SDP4BitFabricStrategy": "lightning_sdp4bit.strategies.fabric",
    "SDP4BitSimulationStrategy": "lightning_sdp4bit.strategies.simulation",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lightning_sdp4bit.strategies' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
