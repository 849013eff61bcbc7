"""Lightning strategies of lightning-sdp4bit, installed as `lightning_sdp4bit.strategies`."""

from lightning_sdp4bit.strategies.sdp4bit import SUPPORTED_PRECISIONS, SDP4BitStrategy

__all__ = ["SUPPORTED_PRECISIONS", "SDP4BitStrategy"]
