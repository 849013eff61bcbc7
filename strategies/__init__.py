"""Lightning strategies of lightning-sdp4bit, installed as `lightning_sdp4bit.strategies`."""
