"""A job of W ranks on one device, with the math of W processes (see `simulation.engine`)."""

from lightning_sdp4bit.simulation.engine import SimulatedEngine, parse_world

__all__ = ["SimulatedEngine", "parse_world"]
