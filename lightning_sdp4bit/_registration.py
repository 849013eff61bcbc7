"""Register the strategy names with Lightning without importing Lightning.

`Trainer(strategy="sdp4bit")` looks the name up in `lightning.pytorch.strategies.StrategyRegistry`.
Importing Lightning just to register would make `import lightning_sdp4bit` take seconds, so the
names are registered the moment Lightning's strategies module finishes loading: at once if it
is already loaded, otherwise by a small import hook that waits for it. Lightning offers no entry
point for this (its only entry-point group is for callbacks, and it loads too late).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Any

__all__ = ["install_registration_hook"]

_TARGET = "lightning.pytorch.strategies"
STRATEGY_NAMES = {"sdp4bit": "popen", "sdp4bit_spawn": "spawn"}  # name -> start_method


def _create_strategy(start_method: str) -> Any:
    # Imported on use: registration runs while Lightning is still importing itself.
    from lightning_sdp4bit.strategies import SDP4BitStrategy

    return SDP4BitStrategy(start_method=start_method)


def _register(strategies_module: ModuleType) -> None:
    registry = strategies_module.StrategyRegistry
    for name, start_method in STRATEGY_NAMES.items():
        if name not in registry:
            description = f"SDP4Bit sharded data parallelism, start_method={start_method!r}"
            registry.register(name, _create_strategy, description=description, start_method=start_method)


class _RegisteringLoader(importlib.abc.Loader):
    """Runs the real loader, then registers. Everything else is delegated to the real loader."""

    def __init__(self, loader: importlib.abc.Loader):
        self._loader = loader

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _register(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _RegisterWhenImported(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps find_spec below from recursing
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisteringLoader(spec.loader)
        return spec


def install_registration_hook() -> None:
    module = sys.modules.get(_TARGET)
    if module is not None and hasattr(module, "StrategyRegistry"):
        _register(module)
    elif not any(isinstance(finder, _RegisterWhenImported) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterWhenImported())
