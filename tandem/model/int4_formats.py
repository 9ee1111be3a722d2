"""Readers of quantized checkpoints' linear layers: each published layout to one common form.

4-bit formats become (q [out, in] uint8 0..15, scales [out, groups] float32, zeros [out, groups]
float32) with weight = (q - zero) * scale, which `Int4Linear` packs into its kernel's layout.
FP8 weights are dequantized to float here (tandem/model/loader.py says why).

Layouts (a checkpoint tensor `W` of a linear layer with `out` x `in` weights, int32 words holding
eight 4-bit values, value j in bits 4j..4j+3):
- AWQ GEMM: qweight [in, out/8] packed along out in the order 0, 2, 4, 6, 1, 3, 5, 7 (word nibble
  i holds column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]); qzeros [in/group, out/8] the same way;
  scales [in/group, out]. Zeros are unsigned, weight = (q - zero) * scale.
- GPTQ: qweight [in/8, out] packed along in, in order; qzeros [groups, out/8] along out, in order,
  stored as zero - 1 in v1 checkpoints (`checkpoint_format: "gptq"`, as the CUDA kernels read them,
  so a stored 15 is a zero of 16) and as is in "gptq_v2"; scales [groups, out]; g_idx [in], the
  group of each input row: in order (i // group), or permuted by act-order (`desc_act`), where the
  groups are consecutive runs of `group` inputs in order of decreasing activation size.
- compressed-tensors pack-quantized: weight_packed [out, in/8] along in, in order, values offset
  by 8 (signed -8..7 stored as 0..15); weight_scale [out, groups]; weight_zero_point (asymmetric
  only) [out/8, groups] packed along out with the same offset, so zero = the stored value.
- FP8: weight float8_e4m3fn [out, in] times a scale per tensor ([] or [1]), per output channel
  ([out] or [out, 1]) or per block ([ceil(out/b0), ceil(in/b1)]).
"""

from __future__ import annotations

import torch

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Column j of a group of eight sits in nibble AWQ_NIBBLE_OF[j].
AWQ_NIBBLE_OF = tuple(AWQ_PACK_ORDER.index(j) for j in range(8))

# (q [out, in] 0..15 in the checkpoint's input order, scales [out, groups], zeros [out, groups],
# None or the input order that makes each group contiguous: act-order checkpoints).
Int4Parts = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]


def group_order(name: str, g_idx: torch.Tensor | None, groups: int, in_f: int) -> torch.Tensor | None:
    """None when g_idx is absent or in order; else the permutation of inputs that sorts them by
    group (stable), after checking every group has the same number of inputs."""
    if g_idx is None:
        return None
    _expect(name, g_idx, (in_f,))
    g = g_idx.to(torch.int64)
    group = in_f // groups
    in_order = torch.arange(in_f, dtype=torch.int64) // group
    if torch.equal(g, in_order):
        return None
    perm = torch.argsort(g, stable=True)
    if not torch.equal(g[perm], in_order):
        raise ValueError(f"{name} does not give each of the {groups} groups {group} inputs")
    return perm


def unpack_int32(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., c] -> uint8 [..., 8c]: value j of each word (bits 4j..4j+3) in order."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (words.to(torch.int32).unsqueeze(-1) >> shifts) & 0x0F
    return nibbles.reshape(*words.shape[:-1], words.shape[-1] * 8).to(torch.uint8)


def _expect(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} has dtype {t.dtype}, expected {dtype}")


def _groups(group_size: int | None, in_features: int, name: str) -> int:
    group = group_size or in_features
    if in_features % group:
        raise ValueError(f"{name}: group_size {group} does not divide in_features {in_features}")
    return in_features // group


def read_awq(name: str, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
             group_size: int | None) -> Int4Parts:
    in_f, out_f = qweight.shape[0], qweight.shape[1] * 8
    g = _groups(group_size, in_f, name)
    _expect(f"{name}.qweight", qweight, (in_f, out_f // 8), torch.int32)
    _expect(f"{name}.qzeros", qzeros, (g, out_f // 8), torch.int32)
    _expect(f"{name}.scales", scales, (g, out_f))
    order = torch.tensor(AWQ_NIBBLE_OF)
    cols = (torch.arange(out_f // 8)[:, None] * 8 + order).reshape(-1)  # natural column -> unpacked index
    q = unpack_int32(qweight)[:, cols]  # [in, out]
    zeros = unpack_int32(qzeros)[:, cols]  # [groups, out]
    return q.T.contiguous(), scales.float().T.contiguous(), zeros.float().T.contiguous(), None


def read_gptq(name: str, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              g_idx: torch.Tensor | None, group_size: int | None, v1: bool) -> Int4Parts:
    in_f, out_f = qweight.shape[0] * 8, qweight.shape[1]
    g = _groups(group_size, in_f, name)
    _expect(f"{name}.qweight", qweight, (in_f // 8, out_f), torch.int32)
    _expect(f"{name}.qzeros", qzeros, (g, out_f // 8), torch.int32)
    _expect(f"{name}.scales", scales, (g, out_f))
    perm = group_order(f"{name}.g_idx", g_idx, g, in_f)
    q = unpack_int32(qweight.T.contiguous())  # [out, in]: word i of a column holds inputs 8i..8i+7
    zeros = unpack_int32(qzeros).float() + (1.0 if v1 else 0.0)  # [groups, out]
    return q.contiguous(), scales.float().T.contiguous(), zeros.T.contiguous(), perm


def read_compressed_tensors(name: str, packed: torch.Tensor, scale: torch.Tensor,
                            zero_point: torch.Tensor | None, shape: torch.Tensor | None,
                            g_idx: torch.Tensor | None) -> Int4Parts:
    out_f = packed.shape[0]
    in_f = int(shape[1]) if shape is not None else packed.shape[1] * 8
    if shape is not None and (int(shape[0]) != out_f or packed.shape[1] != -(-in_f // 8)):
        raise ValueError(
            f"{name}.weight_packed has shape {tuple(packed.shape)}, not a packed {tuple(int(v) for v in shape)}"
        )
    _expect(f"{name}.weight_packed", packed, (out_f, -(-in_f // 8)), torch.int32)
    if scale.dim() != 2 or scale.shape[0] != out_f or in_f % scale.shape[1]:
        raise ValueError(f"{name}.weight_scale has shape {tuple(scale.shape)}, expected [{out_f}, groups]")
    g = scale.shape[1]
    perm = group_order(f"{name}.weight_g_idx", g_idx, g, in_f)
    q = unpack_int32(packed)[:, :in_f].contiguous()
    if zero_point is None:
        zeros = torch.full((out_f, g), 8.0)
    else:
        _expect(f"{name}.weight_zero_point", zero_point, (-(-out_f // 8), g), torch.int32)
        zeros = unpack_int32(zero_point.T.contiguous())[:, :out_f].T.float().contiguous()
    return q, scale.float().contiguous(), zeros, perm


def dequantize_fp8(name: str, weight: torch.Tensor, scale: torch.Tensor,
                   block: tuple[int, int] | None, dtype: torch.dtype) -> torch.Tensor:
    """An FP8 weight [out, in] times its tensor, channel or block scales, in `dtype`."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}.weight has dtype {weight.dtype}, expected torch.float8_e4m3fn")
    out_f, in_f = weight.shape
    s = scale.float()
    if s.numel() == 1:
        full = s.reshape(1, 1)
    elif s.dim() <= 2 and s.numel() == out_f and (s.dim() == 1 or s.shape[1] == 1):
        full = s.reshape(out_f, 1)
    else:
        if block is None:
            raise ValueError(f"{name}: scale of shape {tuple(scale.shape)} needs a weight block size")
        b0, b1 = block
        expect = (-(-out_f // b0), -(-in_f // b1))
        if tuple(s.shape) != expect:
            raise ValueError(f"{name}: block scale has shape {tuple(s.shape)}, expected {expect}")
        full = s.repeat_interleave(b0, 0)[:out_f].repeat_interleave(b1, 1)[:, :in_f]
    return (weight.float() * full).to(dtype)
