"""Register the strategy names with Lightning without importing Lightning.

`Trainer(strategy="sdp4bit")` looks the name up in `lightning.pytorch.strategies.StrategyRegistry`,
`Fabric(strategy="sdp4bit")` in `lightning.fabric.strategies.STRATEGY_REGISTRY`. Importing
Lightning just to register would make `import lightning_sdp4bit` take seconds, so the names are
registered the moment each of those modules finishes loading: at once if it is already loaded,
otherwise by a small import hook that waits for it. Lightning offers no entry point for this
(its only entry-point group is for callbacks, and it loads too late).

The same hook makes `LightningModule.load_from_checkpoint` read sharded directories: it wraps
the loader that `lightning.pytorch.core.saving` calls (`checkpoint.lightning_load`).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["install_registration_hook"]

STRATEGY_NAMES = {"sdp4bit": "popen", "sdp4bit_spawn": "spawn"}  # name -> start_method


def _create_strategy(start_method: str) -> Any:
    # Imported on use: registration runs while Lightning is still importing itself.
    from lightning_sdp4bit.strategies import SDP4BitStrategy

    return SDP4BitStrategy(start_method=start_method)


def _create_fabric_strategy(start_method: str) -> Any:
    from lightning_sdp4bit.strategies import SDP4BitFabricStrategy

    return SDP4BitFabricStrategy(start_method=start_method)


def _register_names(attribute: str, factory: Any, strategies_module: ModuleType) -> None:
    registry = getattr(strategies_module, attribute)
    for name, start_method in STRATEGY_NAMES.items():
        if name not in registry:
            description = f"SDP4Bit sharded data parallelism, start_method={start_method!r}"
            registry.register(name, factory, description=description, start_method=start_method)


def _load_sharded_too(saving_module: ModuleType) -> None:
    from lightning_sdp4bit.checkpoint.lightning_load import sharded_aware

    if not getattr(saving_module.pl_load, "__wrapped__", None):
        saving_module.pl_load = sharded_aware(saving_module.pl_load)  # type: ignore[attr-defined]  # Lightning's module


# module -> (the attribute it must have, what to do once it has loaded)
_TARGETS: dict[str, tuple[str, Callable[[ModuleType], None]]] = {
    "lightning.pytorch.strategies": (
        "StrategyRegistry",
        functools.partial(_register_names, "StrategyRegistry", _create_strategy),
    ),
    "lightning.fabric.strategies": (
        "STRATEGY_REGISTRY",
        functools.partial(_register_names, "STRATEGY_REGISTRY", _create_fabric_strategy),
    ),
    "lightning.pytorch.core.saving": ("pl_load", _load_sharded_too),
}


def _register(module: ModuleType) -> None:
    _TARGETS[module.__name__][1](module)


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
    """Waits for one target module; one instance per target, each removed once it has fired."""

    def __init__(self, target: str):
        self.target = target

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.target:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps find_spec below from recursing
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisteringLoader(spec.loader)
        return spec


def install_registration_hook() -> None:
    for target, (attribute, _) in _TARGETS.items():
        module = sys.modules.get(target)
        if module is not None and hasattr(module, attribute):
            _register(module)
        elif not any(isinstance(f, _RegisterWhenImported) and f.target == target for f in sys.meta_path):
            sys.meta_path.insert(0, _RegisterWhenImported(target))
