"""The reference compression's outputs, pinned: SHA-256 digests (first 16 hex digits) of every op's
bytes for fixed inputs, both roundings, 2/4/8 bits, fp32 and bf16 weights.

The digests were computed with the reference as it was before its CPU speed-ups (main at
fb00191), so any rewrite for speed that changes a single output bit (a code, a scale, a NaN or a
signed zero included) fails here. Stochastic rounding is pinned too: its noise comes from
`uniform_noise`, which the CPU path must keep drawing in the same order.
"""

import hashlib

import torch

from lightning_sdp4bit.reference import dequantize, ops, quantize

GOLDEN = {
    "dequantize-2-nearest": "e9527530165cb114",
    "dequantize-4-nearest": "20f3f338f38f2fa9",
    "dequantize-8-nearest": "6cc9e7f935d924c1",
    "grad_decode_sum-2-nearest": "a734d23abe100be9",
    "grad_decode_sum-2-stochastic": "308e083a03d86e90",
    "grad_decode_sum-4-nearest": "9382b7121ab3b63e",
    "grad_decode_sum-4-stochastic": "a05f50effef24bce",
    "grad_decode_sum-8-nearest": "d2e0bf57af28aeb7",
    "grad_decode_sum-8-stochastic": "a9fc605357a4af7f",
    "grad_encode-2-nearest": "b0fe123fb212cb0c",
    "grad_encode-2-stochastic": "cebdbd8a86684dff",
    "grad_encode-4-nearest": "97de83fe6badad13",
    "grad_encode-4-stochastic": "7f4782bd6ec54212",
    "grad_encode-8-nearest": "625705ccb5434715",
    "grad_encode-8-stochastic": "98eeedb9b1f6c522",
    "grad_requantize-2-nearest": "08785effd4f7c069",
    "grad_requantize-2-stochastic": "0b328dc2c8d2d9d7",
    "grad_requantize-4-nearest": "cd243df6623e1249",
    "grad_requantize-4-stochastic": "23f1ad24ce29af79",
    "grad_requantize-8-nearest": "a5e335fd1d5a9ff8",
    "grad_requantize-8-stochastic": "cea2d563bf43c073",
    "quantize-2-nearest": "784f805729d4d775",
    "quantize-4-nearest": "48f39938f2e8158a",
    "quantize-8-nearest": "3f62823448560491",
    "weight_update_apply-2-nearest-torch.bfloat16": "2ff6a636bd94ff9f",
    "weight_update_apply-2-nearest-torch.float32": "64bdeda7767870fb",
    "weight_update_apply-2-stochastic-torch.bfloat16": "5a4541bac041856b",
    "weight_update_apply-2-stochastic-torch.float32": "02bfde9992c74b21",
    "weight_update_apply-4-nearest-torch.bfloat16": "b20d51c8c2dc1fbc",
    "weight_update_apply-4-nearest-torch.float32": "51c39b755b52dd8d",
    "weight_update_apply-4-stochastic-torch.bfloat16": "15dfe299c60b3751",
    "weight_update_apply-4-stochastic-torch.float32": "aba983194e60d0b6",
    "weight_update_apply-8-nearest-torch.bfloat16": "ca1b8fd7003ecce6",
    "weight_update_apply-8-nearest-torch.float32": "6db85a378225340e",
    "weight_update_apply-8-stochastic-torch.bfloat16": "336d9507a0775dde",
    "weight_update_apply-8-stochastic-torch.float32": "554219aab780b356",
    "weight_update_encode-2-nearest-torch.bfloat16": "2c0b2f4d45219b9c",
    "weight_update_encode-2-nearest-torch.float32": "38886e4ad080bfdf",
    "weight_update_encode-2-stochastic-torch.bfloat16": "c2b3a96944656dfe",
    "weight_update_encode-2-stochastic-torch.float32": "cabcfccedb674aa7",
    "weight_update_encode-4-nearest-torch.bfloat16": "a2b165e0ed8cfa94",
    "weight_update_encode-4-nearest-torch.float32": "1126ec6143602096",
    "weight_update_encode-4-stochastic-torch.bfloat16": "b1ce49646c7fc590",
    "weight_update_encode-4-stochastic-torch.float32": "74d508092a05bd97",
    "weight_update_encode-8-nearest-torch.bfloat16": "f1b676f4fded5951",
    "weight_update_encode-8-nearest-torch.float32": "5fa4459c6e6c1f50",
    "weight_update_encode-8-stochastic-torch.bfloat16": "1bb6af4616f8241e",
    "weight_update_encode-8-stochastic-torch.float32": "e0328f69bd442e13",
}


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _digests() -> dict[str, str]:
    g = torch.Generator().manual_seed(2026)
    x = torch.randn(8192, generator=g) * 10 ** torch.randint(-3, 3, (8192,), generator=g)
    x[::97] = 0.0
    x[:128] = -0.0
    out = {}
    for bits in (2, 4, 8):
        for rounding in ("nearest", "stochastic"):
            key = f"{bits}-{rounding}"
            enc = ops.torch_grad_encode(x, 2, 2, 32, bits, 128, rounding, 7)
            out[f"grad_encode-{key}"] = enc
            out[f"grad_requantize-{key}"] = ops.torch_grad_requantize(enc, bits, 4, 128, 2, rounding, 9)
            flat = ops.torch_grad_encode(x, 1, 4, 32, bits, 128, rounding, 7)
            out[f"grad_decode_sum-{key}"] = ops.torch_grad_decode_sum(flat, bits, 128, 32)
            for dtype in (torch.float32, torch.bfloat16):
                w = (x * 0.5).to(dtype)
                payload = ops.torch_weight_update_encode(x[:2048], w[:2048], bits, 512, rounding, 5)
                out[f"weight_update_encode-{key}-{dtype}"] = payload
                out[f"weight_update_apply-{key}-{dtype}"] = ops.torch_weight_update_apply(
                    payload.repeat(4, 1), w.clone(), bits, 512, True
                )
            if rounding == "nearest":  # the public quantize() with seeds is tested in test_reference_quantize.py
                quantized = quantize(x[:8000], bits, 64, rounding)
                out[f"quantize-{key}"] = torch.cat([quantized.codes, quantized.scales.view(torch.uint8)])
                out[f"dequantize-{key}"] = dequantize(quantized)
    return {k: hashlib.sha256(_bytes(v)).hexdigest()[:16] for k, v in out.items()}


def test_every_reference_output_is_bit_identical_to_the_pinned_digests():
    got = _digests()
    assert got.keys() == GOLDEN.keys()
    changed = sorted(k for k in GOLDEN if got[k] != GOLDEN[k])
    assert not changed, f"reference outputs changed: {changed}"
