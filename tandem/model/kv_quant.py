"""The KV cache's storage format (`kv_cache_dtype`): the model dtype, or int8 / fp8 with scales.

`auto` keeps K and V in the model dtype, one element per value: `[2, num_blocks, block_size,
kv_heads, head_dim]` per layer, as before. `int8` and `fp8_e4m3` (alias `fp8`) store each
(token, KV head) row of `head_dim` values as one byte each, followed by its own float32 scale,
packed into one uint8 row of `row_bytes` bytes (the values, zero padding to a 4-byte boundary,
then the scale): a layer's cache is `[2, num_blocks, block_size, kv_heads, row_bytes]` uint8.

Why this layout:
- One scale per token per KV head, computed when the row is written (int8: max|x| / 127, rounded
  to nearest; fp8: max|x| / 448, e4m3's largest finite value), needs no calibration and never
  changes afterwards: a per-block or per-tensor scale would have to be known before the values
  arrive, or rescale rows already written when a larger value comes. K rows differ in magnitude
  from head to head and token to token (rotary, outlier channels), so a fine scale keeps the
  error at about half a step of each row's own range.
- The scale lives inside the row, so a block is self-contained: everything that moves blocks
  (copy-on-write copies, prefix sharing, `read_blocks` / `write_blocks` for live migration and
  prefill/decode hand-off, the timing passes) moves the scales with the values without knowing
  they are there, and the cache stays one tensor per layer.
- float32 scales cost 4 bytes per row: at head_dim 64 a row is 68 bytes against 128 in bfloat16
  (1.88x the tokens) and 256 in float32 (3.76x); at head_dim 128, 1.94x and 3.88x. A 16-bit
  scale would gain 3% more tokens at the price of range (tiny rows underflow in float16).

Every reader sees the quantized values: attention also uses the dequantized K/V of the step's own
new tokens, so a prompt computed in one pass, in chunks, after a prefix-cache hit or again after
preemption attends to exactly the same keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The names `kv_cache_dtype` accepts (vLLM's), and what each alias means.
KV_CACHE_ALIASES = {"fp8": "fp8_e4m3"}
QUANTIZED_KV_DTYPES = ("int8", "fp8_e4m3")

# Largest magnitude of each quantized format: a row's max|x| maps onto it.
_QMAX = {"int8": 127.0, "fp8_e4m3": float(torch.finfo(torch.float8_e4m3fn).max)}
_ELEMENT = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
SCALE_BYTES = 4  # one float32 per row


def canonical_kv_cache_dtype(name: str) -> str:
    return KV_CACHE_ALIASES.get(name, name)


@dataclass(frozen=True, slots=True)
class KVCacheFormat:
    """How one engine stores K and V: `kv_cache_dtype` ("auto", "int8", "fp8_e4m3"; "fp8" is taken as
    "fp8_e4m3") over a model computing in `model_dtype`."""

    kv_cache_dtype: str
    model_dtype: torch.dtype

    def __post_init__(self) -> None:
        canonical = canonical_kv_cache_dtype(self.kv_cache_dtype)
        if canonical not in ("auto", *QUANTIZED_KV_DTYPES):
            raise ValueError(
                f"kv_cache_dtype must be auto, int8, fp8 or fp8_e4m3, got {self.kv_cache_dtype!r}"
            )
        object.__setattr__(self, "kv_cache_dtype", canonical)

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def name(self) -> str:
        """What the cache holds, for two engines to compare before moving KV between them: the model
        dtype's name under auto (bfloat16 and float16 have the same size but not the same bits)."""
        return self.kv_cache_dtype if self.quantized else str(self.model_dtype).removeprefix("torch.")

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8 if self.quantized else self.model_dtype

    def row_size(self, head_dim: int) -> int:
        """Elements of `storage_dtype` one (token, KV head) row takes."""
        if not self.quantized:
            return head_dim
        return self._scale_offset(head_dim) + SCALE_BYTES

    def row_bytes(self, head_dim: int) -> int:
        return self.row_size(head_dim) * torch.empty((), dtype=self.storage_dtype).element_size()

    def allocate(
        self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, device: torch.device | str
    ) -> torch.Tensor:
        """One layer's cache: `[2, num_blocks, block_size, kv_heads, row_size]`."""
        shape = (2, num_blocks, block_size, kv_heads, self.row_size(head_dim))
        return torch.zeros(shape, dtype=self.storage_dtype, device=device)

    @staticmethod
    def _scale_offset(head_dim: int) -> int:
        return -(-head_dim // SCALE_BYTES) * SCALE_BYTES  # the float32 scale must be 4-byte aligned

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """Rows `[..., head_dim]` as the cache stores them: `[..., row_size]` (unchanged under auto)."""
        if not self.quantized:
            return x.to(self.model_dtype)
        head_dim = x.shape[-1]
        qmax = _QMAX[self.kv_cache_dtype]
        xf = x.float()
        amax = xf.abs().amax(dim=-1, keepdim=True)
        scale = amax / qmax
        # An all-zero row keeps scale 0 and quantizes to zeros (dividing by 1 instead of 0).
        y = (xf / torch.where(amax > 0, scale, torch.ones_like(scale))).clamp_(-qmax, qmax)
        values = y.round_().to(torch.int8) if self.kv_cache_dtype == "int8" else y.to(torch.float8_e4m3fn)
        off = self._scale_offset(head_dim)
        out = torch.zeros(*x.shape[:-1], off + SCALE_BYTES, dtype=torch.uint8, device=x.device)
        out[..., :head_dim] = values.view(torch.uint8)
        out[..., off:].view(torch.float32).copy_(scale)
        return out

    def dequantize(self, rows: torch.Tensor, head_dim: int) -> torch.Tensor:
        """Stored rows `[..., row_size]` back to `[..., head_dim]` in the model dtype."""
        if not self.quantized:
            return rows
        off = self._scale_offset(head_dim)
        values = rows[..., :head_dim].view(_ELEMENT[self.kv_cache_dtype])
        scale = rows[..., off : off + SCALE_BYTES].view(torch.float32)
        return (values.float() * scale).to(self.model_dtype)
