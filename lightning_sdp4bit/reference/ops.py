"""Reference twins of the five fused compression ops, the wire format they share, and the twin of
the weight-edit check (`torch_absorb_weight_edits`).

Each `torch_*` function here has a Triton kernel in `lightning_sdp4bit.kernels` that must give
the same bytes with nearest rounding (stochastic rounding draws its noise differently there, so
it is checked statistically). `lightning_sdp4bit.ops` picks one of the two per call.

**Payload** (what one all-to-all or all-gather chunk carries): for fp32 rows x [P, n], with n a
multiple of the group size g and of 32/bits, the payload is uint8 [P, row_bytes] where each row
is the packed b-bit codes of x[p] (n*b/8 bytes) followed by the fp32 scales of its n/g groups
(4n/g bytes, native byte order). Codes and scales of a chunk are contiguous, so each chunk is one
slice of the collective's buffer, and a row costs exactly b + 32/g bits per element.

Glossary of the tensors the ops see (sizes in elements; W ranks, L per node, M = W/L nodes,
S = shard size, bucket numel N = W*S):
- **master shard**: fp32 [S], this rank's optimizer-owned slice of a bucket.
- **model weights**: the bucket's full weights [N] in the module's dtype, identical on all ranks.
- **weight update payload**: a rank's quantized weight difference (or weights, for qW), [1, row].
- **rotated gradient**: the bucket's gradient after the blockwise Hadamard transform.
- **intra-node payload**: [L, row(M*S)], chunk l holds the shards of local index l on all nodes.
- **inter-node payload**: [M, row(S)], chunk m holds the shard of node m at this local index.
- **gradient shard**: fp32 [S], this rank's slice of the averaged bucket gradient.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_sdp4bit.config import Rounding, coerce_enum
from lightning_sdp4bit.reference.hadamard import butterflies, hadamard_scale
from lightning_sdp4bit.reference.quantize import pack_into, round_groups, uniform_noise, unpack_codes

__all__ = [
    "assemble_pieces",
    "decode_rows",
    "encode_rows",
    "payload_row_bytes",
    "stage_seed",
    "torch_absorb_weight_edits",
    "torch_grad_decode_sum",
    "torch_grad_encode",
    "torch_grad_encode_pieces",
    "torch_grad_requantize",
    "torch_weight_update_apply",
    "torch_weight_update_encode",
]

_MASK64 = 2**64 - 1


def stage_seed(*parts: int) -> int:
    """A 31-bit seed mixed from integers (base seed, step, bucket, rank, stage): splitmix64 steps.

    Every rank derives its own stream for every step, bucket and stage, so runs are reproducible
    and no two quantizations share their noise.
    """
    state = 0x9E3779B97F4A7C15
    for part in parts:
        state = (state ^ (int(part) & _MASK64)) & _MASK64
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        state = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        state = ((state ^ (state >> 27)) * 0x94D049BB133111EB) & _MASK64
        state ^= state >> 31
    return state & 0x7FFFFFFF


def payload_row_bytes(numel: int, bits: int, group_size: int) -> int:
    """Bytes of one payload row of `numel` elements: codes, then one fp32 scale per group."""
    if numel % group_size or (numel * bits) % 32:
        raise ValueError(
            f"a payload row of {numel} elements must hold whole groups of {group_size} and whole "
            f"32-bit words of {bits}-bit codes"
        )
    return numel * bits // 8 + 4 * (numel // group_size)


def encode_rows(x: Tensor, bits: int, group_size: int, rounding: Rounding | str, seed: int) -> Tensor:
    """Quantize fp32 rows x [P, n] into a payload uint8 [P, row_bytes(n)].

    Stochastic noise is `uniform_noise(P * n, seed)` in x's row-major order.
    """
    return _encode(x.float(), bits, group_size, rounding, seed, torch.empty(x.shape, device=x.device))


def _encode(x: Tensor, bits: int, group_size: int, rounding: Rounding | str, seed: int, scratch: Tensor) -> Tensor:
    """`encode_rows` of fp32 x [P, n], rounding into `scratch` (contiguous, x's shape; it may be x).

    Codes go straight into the payload's slices: 8-bit codes are cast into it, narrower
    ones packed into it."""
    rounding = coerce_enum("rounding", rounding, Rounding)
    rows, numel = x.shape
    row_bytes = payload_row_bytes(numel, bits, group_size)
    code_bytes = numel * bits // 8
    payload = torch.empty(rows, row_bytes, dtype=torch.uint8, device=x.device)
    noise = uniform_noise(x.numel(), seed, x.device) if rounding is Rounding.STOCHASTIC else None
    groups = x.reshape(-1, group_size)
    codes, scales = round_groups(groups, bits, rounding, noise, out=scratch.view(groups.shape))
    payload[:, code_bytes:].view(torch.float32).copy_(scales.view(rows, -1))
    if bits == 8:
        payload[:, :code_bytes].view(torch.int8).copy_(codes.view(rows, numel))
    else:
        pack_into(codes.to(torch.int8), bits, payload[:, :code_bytes])
    return payload


def decode_rows(payload: Tensor, bits: int, group_size: int, numel: int) -> Tensor:
    """Dequantize a payload uint8 [P, row_bytes(numel)] into fp32 rows [P, numel]."""
    out = torch.empty(payload.shape[0], numel, device=payload.device)
    for row, values in zip(payload, out, strict=True):
        _decode_row(row, bits, group_size, numel, out=values)
    return out


def _decode_row(row: Tensor, bits: int, group_size: int, numel: int, out: Tensor | None = None) -> Tensor:
    """One payload row uint8 [row_bytes(numel)] into fp32 [numel] (into `out` if given)."""
    code_bytes = numel * bits // 8
    codes = unpack_codes(row[:code_bytes], bits, numel)
    scales = row[code_bytes:].view(torch.float32)
    values = torch.mul(
        codes.view(-1, group_size), scales[:, None], out=None if out is None else out.view(-1, group_size)
    )
    return values.view(numel)


def _sum_rows(payload: Tensor, bits: int, group_size: int, numel: int) -> Tensor:
    """Dequantize the rows of a payload [P, row_bytes(numel)] and sum them strictly in order
    0, 1, ..., P-1 in fp32 (the kernels use this order): fp32 [numel]."""
    total = _decode_row(payload[0], bits, group_size, numel)
    values = torch.empty_like(total) if payload.shape[0] > 1 else None
    for row in payload[1:]:
        total += _decode_row(row, bits, group_size, numel, out=values)
    return total


def torch_weight_update_encode(
    master: Tensor,
    weights: Tensor | None,
    bits: int,
    group_size: int,
    rounding: Rounding | str,
    seed: int,
) -> Tensor:
    """Sender side of the weight all-gather: payload [1, row_bytes(S)].

    With `weights` (qWD), it quantizes the weight difference
    fp32(master rounded to weights.dtype) - fp32(weights); with `weights=None` (qW), it
    quantizes fp32(master) itself. master: fp32 or bf16 [S]; weights: [S].
    """
    if weights is None:
        return encode_rows(master.view(1, -1), bits, group_size, rounding, seed)
    # A fresh fp32 difference (the mixed-dtype sub computes fp32(a) - fp32(b)), rounded in place.
    target = torch.sub(master.to(weights.dtype).float(), weights).view(1, -1)
    return _encode(target, bits, group_size, rounding, seed, scratch=target)


def torch_weight_update_apply(
    payload: Tensor,
    weights: Tensor,
    bits: int,
    group_size: int,
    additive: bool,
    nodes: int = 1,
    applied: Tensor | None = None,
    rank: int = 0,
) -> Tensor:
    """Receiver side: dequantize the gathered payload [W, row_bytes(S)] into weights [W*S], in place.

    additive (qWD): weights = dtype(fp32(weights) + difference); otherwise (qW): weights = dtype(values).
    Every rank, the sender included, runs this on the same bytes, so replicas stay bit-identical.
    The rows are local-major [L, M] with M = `nodes`, L = W // nodes (as a two-level all-gather
    lands them, across nodes first): the shard of rank m * L + l is row l * M + m. nodes = 1 (or
    W) is rank order. Row by row through one fp32 buffer: the sum is computed in fp32 and rounded
    once to weights.dtype as it is stored, as `copy_` (and `.to()`) round. `applied` [S] (the
    weights' dtype), if given, receives the shard of `rank` in rank order, `weights[rank*S:][:S]`,
    as stored: the applied shard of the engine's edit check (`torch_absorb_weight_edits`).
    Returns weights.
    """
    rows = payload.shape[0]
    shard = weights.numel() // rows
    # [L, M, row] transposed to [M, L, row]: the rows in rank order, as views (no bytes move).
    by_node = payload.view(rows // nodes, nodes, -1).transpose(0, 1)
    values = torch.empty(shard, device=weights.device)
    for row, target in zip(itertools.chain.from_iterable(by_node), weights.view(rows, shard), strict=True):
        _decode_row(row, bits, group_size, shard, out=values)
        if additive:
            torch.add(values, target, out=target)
        else:
            target.copy_(values)
    if applied is not None:
        applied.copy_(weights.view(rows, shard)[rank])
    return weights


def torch_absorb_weight_edits(weights: Tensor, applied: Tensor, master: Tensor) -> Tensor:
    """Take the elements written to the weights since the exchange into the master shard, in place.

    weights: this rank's slice of the model weights [S] (fp32, bf16 or fp16); applied: what the
    last exchange left there [S], same dtype; master: the fp32 master shard [S]. Where
    `weights != applied` (torch's `!=`: a NaN is unequal to everything, itself included, and
    -0.0 equals +0.0), master = fp32(weights); elsewhere master keeps its bits. Returns master.
    """
    # The mixed-dtype where converts the weights to fp32 (exactly) as it writes them.
    return torch.where(weights != applied, weights, master, out=master)


def torch_grad_encode(
    grad: Tensor,
    outer: int,
    chunks: int,
    hadamard_size: int,
    bits: int,
    group_size: int,
    rounding: Rounding | str,
    seed: int,
    scale: float = 1.0,
) -> Tensor:
    """Gradient stage 1: rotate, quantize and lay out a bucket's gradient in destination order.

    grad: fp32 or bf16 [N] with N = outer * chunks * S, multiplied by `scale` in fp32 first (the
    engine's 1/world). The bucket is viewed as [outer, chunks, S]
    and chunk c of the result holds grad[:, c, :] (outer*S elements), so that all-to-all chunk c
    goes to peer c. Two-level: outer = nodes M, chunks = ranks per node L; one rank per node:
    outer = 1, chunks = M. The Hadamard blocks never straddle S, so rotating first is the same as
    rotating each chunk. Returns the payload [chunks, row_bytes(outer*S)].
    """
    x = grad.float() * scale if scale != 1.0 else grad.float()
    shard = x.numel() // (outer * chunks)
    if not hadamard_size:
        rows = x.view(outer, chunks, shard).transpose(0, 1).reshape(chunks, outer * shard)
        return encode_rows(rows, bits, group_size, rounding, seed)
    source = x.view(-1, hadamard_size)
    # Two buffers; the butterflies may overwrite x when it is a copy (bf16 grad) and they run an
    # odd number of stages. The spare then receives the scaled result in destination order.
    odd = (hadamard_size.bit_length() - 1) % 2 == 1
    spare = source if odd and x.data_ptr() != grad.data_ptr() else torch.empty_like(source)
    rotated = butterflies(source, hadamard_size, torch.empty_like(source), spare)
    rows = spare.view(chunks, outer * shard)
    torch.mul(
        rotated.view(outer, chunks, shard),
        hadamard_scale(hadamard_size),
        out=rows.view(chunks, outer, shard).transpose(0, 1),
    )
    return _encode(rows, bits, group_size, rounding, seed, scratch=rows)


def assemble_pieces(pieces: Sequence[Tensor], starts: Sequence[int], numel: int) -> Tensor:
    """The bucket [numel] whose elements starts[i] to starts[i] + pieces[i].numel() are
    pieces[i] (flattened; ascending, not overlapping) and whose other elements are 0, in the
    pieces' dtype."""
    out = pieces[0].new_zeros(numel)
    for piece, start in zip(pieces, starts, strict=True):
        out[start : start + piece.numel()].copy_(piece.reshape(-1))
    return out


def torch_grad_encode_pieces(
    pieces: Sequence[Tensor],
    starts: Sequence[int],
    numel: int,
    outer: int,
    chunks: int,
    hadamard_size: int,
    bits: int,
    group_size: int,
    rounding: Rounding | str,
    seed: int,
    scale: float = 1.0,
) -> Tensor:
    """`torch_grad_encode` of the bucket given in pieces (`assemble_pieces`)."""
    grad = assemble_pieces(pieces, starts, numel)
    return torch_grad_encode(grad, outer, chunks, hadamard_size, bits, group_size, rounding, seed, scale)


def torch_grad_requantize(
    payload: Tensor,
    in_bits: int,
    out_bits: int,
    group_size: int,
    outer: int,
    rounding: Rounding | str,
    seed: int,
) -> Tensor:
    """Gradient stage 2: dequantize the intra-node chunks received from L peers, sum them (in peer
    order) and re-quantize to `out_bits`, staying in the Hadamard domain.

    payload: [L, row_bytes(outer*S)]. Returns [outer, row_bytes(S)]: chunk m goes to node m.
    """
    numel = (payload.shape[1] * 8 * group_size) // (in_bits * group_size + 32)
    total = _sum_rows(payload, in_bits, group_size, numel).view(outer, -1)
    return _encode(total, out_bits, group_size, rounding, seed, scratch=total)


def torch_grad_decode_sum(
    payload: Tensor, bits: int, group_size: int, hadamard_size: int, out: Tensor | None = None
) -> Tensor:
    """Gradient stage 3: dequantize the P chunks of this rank's shard, sum them in order and undo
    the Hadamard transform. payload: [P, row_bytes(S)]; returns (or fills `out`) fp32 [S]."""
    numel = (payload.shape[1] * 8 * group_size) // (bits * group_size + 32)
    total = _sum_rows(payload, bits, group_size, numel)
    if not hadamard_size:
        return total if out is None else out.copy_(total)
    # The inverse transform ends in `out` when it can (contiguous fp32), with the sum as spare.
    target = out if out is not None and out.is_contiguous() and out.dtype == torch.float32 else torch.empty_like(total)
    direct = target is out
    odd = (hadamard_size.bit_length() - 1) % 2 == 1
    blocks = total.view(-1, hadamard_size)
    butterflies(blocks, hadamard_size, target.view(-1, hadamard_size), blocks if odd else None)
    target.mul_(hadamard_scale(hadamard_size))
    return target if out is None or direct else out.copy_(target)
