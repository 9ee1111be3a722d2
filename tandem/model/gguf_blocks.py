"""GGUF tensors as torch tensors: dequantized by ggml's reader, or 4-bit blocks moved into Int4Linear's
packed layout as they are.

ggml's 4-bit formats and Tandem's kernel layout (tandem/model/int4.py) are both 32-element groups
of unsigned nibbles with a float scale, and `q * scale - zs` of the kernel's dequantization is the
same arithmetic ggml's does, so these convert without re-quantizing and dequantize to the same
float32 values bit for bit (the products are exact; one rounding each side):

- Q4_0: 18-byte blocks, fp16 d then 16 bytes whose low nibbles are elements 0..15 and high nibbles
  16..31 (Tandem's block exactly); w = (q - 8) * d: scale d, zero 8 (no `zs`).
- Q4_1: 20-byte blocks, fp16 d, fp16 m, the same 16 bytes; w = q * d + m: scale d, zs = -m.
- Q4_K: 144-byte super-blocks of 256: fp16 d and dmin, twelve bytes of 6-bit scales and minimums
  for its eight groups of 32, then 128 bytes where each 32 bytes hold two groups (64 elements: low
  nibbles the first 32, high nibbles the next 32); w = q * (d * sc) - dmin * m: scale d * sc,
  zs = dmin * m. The nibbles are regrouped into Tandem's 16-byte blocks.

Other types (F32, F16, BF16, Q8_0, Q5_K, Q6_K and the rest ggml's reader knows) are dequantized.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

# ggml types whose blocks Int4Linear takes as they are.
PACKABLE = ("Q4_0", "Q4_1", "Q4_K")
# Elements per group of the packable types (each has one scale, and a minimum where it has one).
GROUP_SIZE = 32
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}


def type_name(tensor: Any) -> str:
    return str(tensor.tensor_type.name)


def can_pack(tensor: Any) -> bool:
    """A 2-D tensor of a packable type (a linear layer's weight; stacked experts are 3-D)."""
    return type_name(tensor) in PACKABLE and len(tensor.data.shape) == 2


def dequantize(tensor: Any) -> torch.Tensor:
    """The tensor in float32 with its logical shape ([out, in] for a weight), by ggml's reader."""
    from gguf import dequantize as ggml_dequantize

    array = ggml_dequantize(tensor.data, tensor.tensor_type)
    if not array.flags.writeable:  # float32 tensors come back as a view of the read-only mapping
        array = array.copy()
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))


def _fp16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def pack_groups(q: np.ndarray) -> np.ndarray:
    """[N, K] values 0..15 -> [N, K/2] bytes in Tandem's layout (per 32: low nibbles 0..15)."""
    n, k = q.shape
    g = q.reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    half = GROUP_SIZE // 2
    return (g[..., :half] | (g[..., half:] << np.uint8(4))).reshape(n, k // 2)


def int4_parts(tensor: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(qweight [N, K/2] uint8, scales [N, K/32] float32, zs [N, K/32] float32 or None) of a
    packable tensor, as `Int4Linear.from_packed` takes them."""
    kind = type_name(tensor)
    if kind not in PACKABLE:
        raise ValueError(f"{tensor.name}: {kind} blocks cannot be kept packed")
    raw = np.asarray(tensor.data)
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, _BLOCK_BYTES[kind])
    zs: np.ndarray | None
    if kind == "Q4_0":
        scales, zs = _fp16(blocks[..., 0:2]), None
        packed = blocks[..., 2:].reshape(rows, -1)
    elif kind == "Q4_1":
        scales, zs = _fp16(blocks[..., 0:2]), -_fp16(blocks[..., 2:4])
        packed = blocks[..., 4:].reshape(rows, -1)
    else:
        from gguf.quants import Q4_K

        supers = blocks.shape[1]
        d, dmin = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])
        sc, mins = Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
        scales = (d[..., None] * sc.reshape(rows, supers, 8).astype(np.float32)).reshape(rows, -1)
        zs = (dmin[..., None] * mins.reshape(rows, supers, 8).astype(np.float32)).reshape(rows, -1)
        nibbles = blocks[..., 16:].reshape(rows, supers, 4, 1, 32) >> np.array(
            [0, 4], dtype=np.uint8
        ).reshape(1, 1, 1, 2, 1)
        packed = pack_groups((nibbles & np.uint8(0x0F)).reshape(rows, -1))
    return (
        torch.from_numpy(np.ascontiguousarray(packed, dtype=np.uint8)),
        torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32)),
        None if zs is None else torch.from_numpy(np.ascontiguousarray(zs, dtype=np.float32)),
    )


def rope_unpermutation(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's permutation of a Llama q or k projection (its converter
    interleaves each head's two rotary halves for ggml's rope; Tandem rotates halves, as
    transformers does): row h*2d + j*d + i of the result is row h*2d + 2i + j of the file's."""
    if rows % (2 * heads):
        raise ValueError(f"cannot un-permute {rows} rows over {heads} heads")
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)
