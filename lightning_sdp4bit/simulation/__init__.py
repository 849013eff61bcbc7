"""A job of W ranks on one device, with the math of W processes (see `simulation.engine`)."""

from lightning_sdp4bit.simulation.engine import SimulatedEngine, check_shape, parse_world

__all__ = ["SimulatedEngine", "check_shape", "parse_world"]
