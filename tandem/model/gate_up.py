"""SiLU-and-multiply inside the gate/up product's epilogue (AMX tile kernels; the bfloat16 column
panels on CPUs with AVX512-BF16 and no AMX).

A gated MLP's fused gate/up layer computes [gate | up] = x . W^T ([M, 2I]) and then
silu(gate) * up ([M, I]): the product writes 2I columns a row and a second pass (a second call)
reads them back. The tile kernels (tandem/kernels/amx_ops.cpp) hand their epilogue one panel of
32 output columns at a time, two tiles of 16: with the weight's rows interleaved 16 at a time
(gate 0-15, up 0-15, gate 16-31, ...) each panel holds 16 gate columns and the same 16 up columns,
and the epilogue writes the activation directly (`gemm_amx_bf16_silu_mul`, `gemm_amx_w8a8_silu_mul`), with the
same roundings as the two passes, so the same bits. At decode rows (1-64) that takes the gate/up
products of the 415M model 0.95-0.99x the time of the two passes in bfloat16 and 0.90-0.94x in
int8 (benchmarks/gate_up_silu.py); its 32-stream int8 decode step 33.3-33.6 ms against 35.0-35.3.

The layer keeps its tiles in the interleaved order only (no second copy); where it still runs as a
plain linear layer (the kernels switched off, rows past its tile path) the output is put back in
gate-then-up order.
"""

from __future__ import annotations

import torch

TILE_COLUMNS = 16  # columns of one AMX result tile


def can_interleave(intermediate: int, out_features: int) -> bool:
    """Whether a [2 * intermediate, K] gate/up weight splits into whole tiles of both halves."""
    return out_features == 2 * intermediate and intermediate > 0 and intermediate % TILE_COLUMNS == 0


def interleave_tiles(tiles: torch.Tensor, intermediate: int) -> torch.Tensor:
    """`amx_pack(w)` of a [2I, K] gate/up weight -> `amx_pack` of its rows interleaved 16 at a time.

    amx_pack's layout is [panel, K block, column tile (2), row, 64 bytes]; column tile t of the
    weight is (panel t // 2, tile t % 2). Gate tiles are 0..I/16-1, up tiles the next I/16."""
    panels, blocks, pair, rows, width = tiles.shape
    half = intermediate // TILE_COLUMNS
    if pair != 2 or panels != half:
        raise ValueError(f"tiles of shape {tuple(tiles.shape)} do not hold a gate/up weight of intermediate {intermediate}")
    column_tiles = tiles.permute(0, 2, 1, 3, 4).reshape(2 * panels, blocks, rows, width)
    stacked = torch.stack((column_tiles[:half], column_tiles[half:]), dim=1)  # [half, 2, blocks, rows, width]
    return stacked.permute(0, 2, 1, 3, 4).contiguous()


def interleave_panels(panels: torch.Tensor, intermediate: int) -> torch.Tensor:
    """`pack_panels(w)` of a [2I, K] gate/up weight (tandem/model/panels.py: [P, K/2, 16, 2], panel
    p holding columns 16p .. 16p + 15) -> the panels of its rows interleaved 16 at a time: gate
    panel i, then up panel i, for each i."""
    half = intermediate // TILE_COLUMNS
    if panels.dim() != 4 or panels.shape[0] != 2 * half or panels.shape[2] != TILE_COLUMNS:
        raise ValueError(f"panels of shape {tuple(panels.shape)} do not hold a gate/up weight of intermediate {intermediate}")
    return torch.stack((panels[:half], panels[half:]), dim=1).reshape(panels.shape).contiguous()


def interleaved_columns(intermediate: int) -> torch.Tensor:
    """Index of the original column at each interleaved position (for per-column scales, sums)."""
    tile = torch.arange(intermediate // TILE_COLUMNS)[:, None, None] * TILE_COLUMNS
    half = torch.arange(2)[None, :, None] * intermediate
    return (tile + half + torch.arange(TILE_COLUMNS)[None, None, :]).reshape(-1)


def deinterleave(y: torch.Tensor, intermediate: int) -> torch.Tensor:
    """[M, 2I] product in the interleaved column order -> gate columns, then up columns."""
    rows = y.shape[0]
    return y.view(rows, intermediate // TILE_COLUMNS, 2, TILE_COLUMNS).transpose(1, 2).reshape(rows, 2 * intermediate)
