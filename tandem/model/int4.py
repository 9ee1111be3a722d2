"""4-bit weight linear layers (AWQ, GPTQ and compressed-tensors int4 checkpoints).

Every 4-bit format is repacked at load (tandem/model/int4_formats.py) into one layout, the one
Tandem's kernel reads: `qweight` [out, in/2] bytes, where each 32-element block of a weight row is
16 bytes whose low nibbles are elements 0..15 and high nibbles elements 16..31, unsigned 0..15;
element k of row n is `(q - zero) * scale` of its group of `group_size` inputs. Scales and
`zs = scale * zero` are float32 [out, in / group_size]; a symmetric layer (every zero 8, as
GPTQ's `sym` and compressed-tensors without zero points write them) keeps no `zs`. That is a
quarter of bfloat16's weight bytes plus 4 (symmetric) or 8 bytes per group. Act-order
checkpoints (GPTQ `desc_act`, compressed-tensors `actorder: group`) group inputs out of order:
their columns are stored sorted by group and `in_perm` gathers the activations into that order
first (a copy of the activations, not of the weight).

Paths, by rows of the product (a decode step of a few streams is a few rows):
- with AVX512-VNNI and no AMX (AMD Zen 4 / Zen 5, Ice Lake, Cooper Lake), every row count:
  `tandem.gemm_int4_panels` (tandem/kernels/panel_ops.cpp) over the weight in column panels
  (tandem/model/panels.py), which replace `qweight`, `scales` and `zs` (`weight_parts()` rebuilds
  them; scales and zero terms float16 where that loses nothing): int8 activations in blocks of 32
  as below, `vpdpbusd` against 16 columns' nibbles at once.
  One row's pass reads the weight at ~80% of the read bandwidth, and from 32 rows on it takes
  0.28-0.36x the time of dequantizing into a bfloat16 GEMM without AMX tiles
  (docs/quantized_checkpoints.md);
- otherwise up to `INT4_KERNEL_MAX_ROWS` rows (bfloat16 rows only up to `INT4_AMX_KERNEL_MAX_ROWS` where
  AMX takes over from there):
  `tandem.gemm_int4` (AVX512-VNNI, or AVX2 + FMA; tandem/kernels/int4_ops.cpp) streams the packed
  weight once per four rows, unpacking in registers; it quantizes the activations to int8 in
  blocks of 32 (one scale per block) and multiplies in integers;
- on AMX, bfloat16 activations, up to `INT4_AMX_MAX_ROWS` rows (speculative verification, larger
  decode batches): `tandem.gemm_amx_int4` (tandem/kernels/amx_ops.cpp) dequantizes one panel of
  32 output columns at a time into a buffer that stays in cache and multiplies every row with it on
  AMX tiles: the weight read once, nothing written;
- more rows, or no kernel: dequantize to the compute dtype and run one GEMM (`F.linear`). The
  dequantized weight is made per call (`tandem.dequant_int4`, or PyTorch ops without kernels), not
  kept: keeping it costs the float model's memory (docs/quantized_checkpoints.md has the timing).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem import kernels
from tandem.kernels.isa import kernel_instructions
from tandem.model.direct_call import BoundTensors, DirectCall
from tandem.model.linear import amx_tiles_available
from tandem.model.panels import (
    fits_half,
    pack_group_panels,
    pack_int4_panels,
    unpack_group_panels,
    unpack_int4_panels,
)

# Rows up to which the 4-bit kernel runs; more go to dequantize-then-GEMM. On an AVX2 host the
# kernel was still 1.2-3.3x faster than dequantize + float32 GEMM at 32-64 rows; with VNNI and
# AMX the two break even near 24 rows (docs/quantized_checkpoints.md). 16 covers decode batches
# and speculative verification on both.
INT4_KERNEL_MAX_ROWS = 16
# On AMX: the 4-bit kernel up to this many rows, then the AMX form up to INT4_AMX_MAX_ROWS (it
# dequantizes each panel once per block of rows, so a long prompt chunk of a wide layer pays that
# many times over; there the two tie, and dequantize-then-GEMM takes more). The crossovers
# (benchmarks/gemm_paths.py --only int4): docs/quantized_checkpoints.md.
INT4_AMX_KERNEL_MAX_ROWS = 12
INT4_AMX_MAX_ROWS = 2048
# Activation dtypes the kernel reads directly.
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# Elements per packed block of the internal layout (and per activation scale in the kernel).
BLOCK = 32


class DequantScratch:
    """The buffer a model's 4-bit layers dequantize into for their large-batch products, one per
    dtype, grown to the largest layer and kept: a model's steps run one at a time and each product
    finishes before the next layer's, so one model's layers share it (the loader gives them one)."""

    def __init__(self) -> None:
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def get(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A flat buffer of at least `numel` elements."""
        buf = self._buffers.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[dtype] = torch.empty(numel, dtype=dtype)
        return buf[:numel]


def check_shape(in_features: int, group_size: int, what: str) -> None:
    """The internal layout's constraints, as a ValueError naming the layer."""
    if in_features % BLOCK:
        raise ValueError(f"{what}: 4-bit layers need in_features divisible by {BLOCK}, got {in_features}")
    if group_size % BLOCK or in_features % group_size:
        raise ValueError(
            f"{what}: group_size must be a multiple of {BLOCK} that divides in_features "
            f"({in_features}), got {group_size}"
        )


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> [N, K/2] uint8 in the internal block layout."""
    n, k = q.shape
    blocks = q.to(torch.uint8).reshape(n, k // BLOCK, 2, BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 in the internal block layout -> [N, K] uint8 values 0..15."""
    n, half = packed.shape
    blocks = packed.reshape(n, half // (BLOCK // 2), 1, BLOCK // 2)
    return torch.cat((blocks & 0x0F, blocks >> 4), dim=2).reshape(n, half * 2)


# The zero point of every group of a symmetric layer (no `zs`).
SYMMETRIC_ZERO = 8.0


def dequantize_torch(
    packed: torch.Tensor, scales: torch.Tensor, zs: torch.Tensor | None, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The weight [N, K] in `dtype`, in plain PyTorch (the reference, and the path without kernels)."""
    q = unpack_nibbles(packed).float()
    n, k = q.shape
    if zs is None:
        zs = scales * SYMMETRIC_ZERO
    w = q.view(n, k // group_size, group_size) * scales[:, :, None] - zs[:, :, None]
    return w.reshape(n, k).to(dtype)


class Int4Linear(BoundTensors, DirectCall, nn.Module):
    """y = x @ W^T + b with W held as 4-bit groups (layout above); computed in x's dtype."""

    # Buffers (register_buffer). Where `panels` hold the weight, qweight, scales and zs are None and
    # panel_scales / panel_zs hold the scales and zero terms ([ceil(N / 16), G, 16]).
    qweight: torch.Tensor | None
    scales: torch.Tensor | None
    zs: torch.Tensor | None
    in_perm: torch.Tensor | None
    panels: torch.Tensor | None
    panel_scales: torch.Tensor | None
    panel_zs: torch.Tensor | None
    _bound = ("qweight", "scales", "zs", "bias", "in_perm", "panels", "panel_scales", "panel_zs")
    _tensors: tuple[torch.Tensor | None, ...]

    def __init__(
        self,
        q: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        group_size: int,
        bias: torch.Tensor | None,
        use_kernel: bool | None = None,
        in_perm: torch.Tensor | None = None,
        scratch: DequantScratch | None = None,
    ) -> None:
        """q [N, K] unsigned 0..15, scales and zeros [N, K / group_size] (zeros may be fractional);
        with `in_perm`, group g holds inputs in_perm[g * group_size : (g + 1) * group_size]."""
        super().__init__()
        n, k = q.shape
        if in_perm is not None:
            in_perm = in_perm.to(torch.int64).contiguous()
            q = q[:, in_perm]
        self.register_buffer("in_perm", in_perm, persistent=False)
        check_shape(k, group_size, "Int4Linear")
        groups = k // group_size
        if tuple(scales.shape) != (n, groups) or tuple(zeros.shape) != (n, groups):
            raise ValueError(
                f"Int4Linear: scales and zeros must be [{n}, {groups}], got "
                f"{tuple(scales.shape)} and {tuple(zeros.shape)}"
            )
        s = scales.detach().float().contiguous()
        self.register_buffer("qweight", pack_nibbles(q), persistent=False)
        self.register_buffer("scales", s, persistent=False)
        z = zeros.detach().float()
        symmetric = bool((z == SYMMETRIC_ZERO).all())
        self.register_buffer("zs", None if symmetric else (s * z).contiguous(), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        self.in_features, self.out_features, self.group_size = k, n, group_size
        # use_kernel=False forces the PyTorch path (tests); None takes what the host has.
        self.choose_paths(use_kernel is not False)
        # Shared by the layers of one model (the loader passes one); a layer made alone has its own.
        self.scratch = scratch if scratch is not None else DequantScratch()
        self.bind_tensors()

    @classmethod
    def from_packed(
        cls,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        zs: torch.Tensor | None,
        group_size: int,
        bias: torch.Tensor | None = None,
        scratch: DequantScratch | None = None,
        use_kernel: bool | None = None,
    ) -> Int4Linear:
        """A layer over data already in the internal layout: qweight [N, K/2] uint8, scales and
        zs (= scale * zero; None: every zero 8) [N, K / group_size] float32. GGUF's 4-bit blocks are
        converted to it directly (tandem/model/gguf_blocks.py), with no zero points to divide out."""
        n, half = qweight.shape
        k = half * 2
        check_shape(k, group_size, "Int4Linear")
        groups = k // group_size
        if qweight.dtype != torch.uint8:
            raise ValueError(f"Int4Linear: qweight must be uint8, got {qweight.dtype}")
        for name, t in (("scales", scales), ("zs", zs)):
            if t is not None and tuple(t.shape) != (n, groups):
                raise ValueError(f"Int4Linear: {name} must be [{n}, {groups}], got {tuple(t.shape)}")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.register_buffer("qweight", qweight.contiguous(), persistent=False)
        layer.register_buffer("scales", scales.detach().float().contiguous(), persistent=False)
        zs = None if zs is None else zs.detach().float().contiguous()
        layer.register_buffer("zs", zs, persistent=False)
        layer.register_buffer("in_perm", None, persistent=False)
        if bias is not None:
            bias = nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        layer.bias = bias
        layer.in_features, layer.out_features, layer.group_size = k, n, group_size
        layer.choose_paths(use_kernel is not False)
        layer.scratch = scratch if scratch is not None else DequantScratch()
        layer.bind_tensors()
        return layer

    def choose_paths(self, use_kernels: bool) -> None:
        """Which product takes how many rows on this host (`use_kernels=False`: PyTorch ops only); on
        a host that runs the panel kernel the weight moves into panels."""
        self.use_kernels = use_kernels
        amx = use_kernels and amx_tiles_available()  # gemm_amx_int4 is built with the other tile products
        self.register_buffer("panels", None, persistent=False)
        self.register_buffer("panel_scales", None, persistent=False)
        self.register_buffer("panel_zs", None, persistent=False)
        if use_kernels and not amx and kernels.has("gemm_int4_panels"):
            qweight, scales, zs = self.weight_parts()
            # float16 group vectors where no value changes: a sixth fewer bytes for groups of 32.
            half = fits_half(scales) and (zs is None or fits_half(zs))
            dtype = torch.float16 if half else torch.float32
            self.panels = pack_int4_panels(unpack_nibbles(qweight))
            self.panel_scales = pack_group_panels(scales).to(dtype)
            self.panel_zs = None if zs is None else pack_group_panels(zs).to(dtype)
            self.qweight = self.scales = self.zs = None
        # The panel kernel takes every row count; the row kernel stands in where it is not built.
        row_kernel = use_kernels and self.panels is None and kernels.has("gemm_int4")
        self.kernel_max_rows = INT4_KERNEL_MAX_ROWS if row_kernel else 0
        # bfloat16 rows from just above amx_min_rows go to the tiles (float32 rows never do: the
        # kernel keeps them up to its limit, which a float32 engine's 13-16-row steps need).
        self.amx_max_rows = INT4_AMX_MAX_ROWS if amx else 0
        self.amx_min_rows = min(INT4_AMX_KERNEL_MAX_ROWS, self.kernel_max_rows) if amx else 0
        self.compiled_dequant = use_kernels and kernels.has("dequant_int4")

    def weight_parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(qweight, scales, zs) in the internal layout, rebuilt from the panels where those hold
        the weight (a copy then: for loading and the rare paths that read it)."""
        if self.panels is None:
            assert self.qweight is not None and self.scales is not None
            return self.qweight, self.scales, self.zs
        n = self.out_features
        assert self.panel_scales is not None
        zs = None if self.panel_zs is None else unpack_group_panels(self.panel_zs, n)
        return pack_nibbles(unpack_int4_panels(self.panels, n)), unpack_group_panels(self.panel_scales, n), zs

    def dequantized(self, dtype: torch.dtype, scratch: bool = False) -> torch.Tensor:
        """The weight [out, in] in `dtype`, inputs in `in_perm` order if there is one. scratch=True
        writes it into a buffer shared by every layer (valid until the next layer's call): the
        per-call path allocates nothing."""
        qweight, scales, zs = self.weight_parts()
        if self.compiled_dequant and dtype in (torch.float32, torch.bfloat16):
            n, k = self.out_features, self.in_features
            out = self.scratch.get(dtype, n * k).view(n, k) if scratch else torch.empty(n, k, dtype=dtype)
            return torch.ops.tandem.dequant_int4(qweight, scales, zs, self.group_size, out)
        return dequantize_torch(qweight, scales, zs, self.group_size, dtype)

    def path(self) -> str:
        """Which products this layer runs (the start-up report)."""
        parts = []
        if self.panels is not None:
            isa = kernel_instructions("gemm_int4_panels")
            return f"int4 kernel gemm_int4_panels ({isa}, weight in column panels, every row count)"
        if self.kernel_max_rows:
            bf16 = f"; bfloat16 <= {self.amx_min_rows}" if self.amx_max_rows else ""
            isa = kernel_instructions("gemm_int4")
            parts.append(f"int4 kernel gemm_int4 ({isa}, <= {self.kernel_max_rows} rows{bf16})")
        if self.amx_max_rows:
            parts.append(f"int4 AMX tiles (bfloat16 <= {self.amx_max_rows} rows)")
        return " + ".join([*parts, "dequantize-then-GEMM"]) if parts else "int4 dequantize-then-GEMM"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            y = self.forward(x.reshape(-1, self.in_features))
            return y.reshape(*x.shape[:-1], self.out_features)
        qweight, scales, zs, bias, in_perm, panels, panel_scales, panel_zs = self._tensors
        if in_perm is not None:
            x = x.index_select(1, in_perm)
        if panels is not None and x.dtype in _KERNEL_DTYPES:
            return torch.ops.tandem.gemm_int4_panels(
                x, panels, self.out_features, panel_scales, panel_zs, self.group_size, bias
            )
        rows = x.shape[0]
        if self.amx_min_rows < rows <= self.amx_max_rows and x.dtype == torch.bfloat16:
            return torch.ops.tandem.gemm_amx_int4(x, qweight, scales, zs, self.group_size, bias)
        if 0 < rows <= self.kernel_max_rows and x.dtype in _KERNEL_DTYPES:
            return torch.ops.tandem.gemm_int4(x, qweight, scales, zs, self.group_size, bias)
        bias = None if bias is None else bias.to(x.dtype)
        return F.linear(x, self.dequantized(x.dtype, scratch=True), bias)


def fuse_int4(parts: list[Int4Linear], bias: torch.Tensor | None) -> Int4Linear:
    """One layer whose output rows are `parts`' in order (the fused q/k/v and gate/up projections)."""
    first = parts[0]
    if any(p.in_features != first.in_features or p.group_size != first.group_size for p in parts):
        raise ValueError("layers fused together must share in_features and group_size")
    perms = [p.in_perm for p in parts]
    same = all(q is None for q in perms) or all(
        q is not None and first.in_perm is not None and torch.equal(q, first.in_perm) for q in perms
    )
    if not same:
        raise ValueError("layers fused together must share their act-order input permutation")
    weights = [p.weight_parts() for p in parts]
    zs = None
    if any(z is not None for _, _, z in weights):
        zs = torch.cat([z if z is not None else s * SYMMETRIC_ZERO for _, s, z in weights])
    fused = Int4Linear.from_packed(
        torch.cat([q for q, _, _ in weights]),
        torch.cat([s for _, s, _ in weights]),
        zs,
        first.group_size,
        bias,
        first.scratch,
        use_kernel=first.use_kernels,
    )
    fused.register_buffer("in_perm", first.in_perm, persistent=False)
    fused.bind_tensors()
    return fused
