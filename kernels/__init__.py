"""Triton kernels of lightning-sdp4bit, installed as `lightning_sdp4bit.kernels`."""
