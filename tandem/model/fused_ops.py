"""Where a model runs its per-token glue (RMSNorm, SiLU-and-multiply, rotary) as compiled kernels.

At one or a few tokens a step, a decoder layer's norms, activation and rotation cost more in
PyTorch operator calls than in arithmetic: each is several operators, each a dispatch and a pass
over the row. tandem/kernels/layer_ops.cpp does each in one call. Their float32 results are not
bit-identical to PyTorch's (the order of a sum, fused multiply-adds), so a float32 model with float
weights keeps PyTorch's operators and stays exactly `transformers`' computation (the parity tests
pin it); bfloat16 models and quantized ones, which are within a tolerance of the reference anyway,
take the kernels wherever the host built them.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem import kernels
from tandem.model.layers import GatedMLP, RMSNorm
from tandem.model.llama import Attention

KERNELS = ("rms_norm", "add_rms_norm", "silu_mul", "rope_")


def wants_fused_ops(dtype: torch.dtype, quantized: bool) -> bool:
    """True unless the model is float32 with float weights (the exact path)."""
    return dtype != torch.float32 or quantized


def use_fused_ops(model: nn.Module) -> list[str]:
    """Switch every RMSNorm, SiLU gated MLP and attention rotation of `model` to the kernels, in
    place; returns which kinds it switched (empty where the kernels did not build)."""
    if not all(kernels.has(op) for op in KERNELS):
        return []
    return set_fused_ops(model, True)


def fuse_into_product(mlp: GatedMLP) -> bool:
    """Have `mlp` run SiLU-and-multiply in its gate/up product's epilogue where that layer can
    (AMX tiles: tandem/model/gate_up.py). Permanent: the layer's tiles change order, and it keeps
    answering as a plain linear layer too."""
    if mlp.gate_up_silu is None:
        layer = mlp.gate_up_proj
        fuse, silu_mul = getattr(layer, "fuse_silu", None), getattr(layer, "silu_mul", None)
        if fuse is None or silu_mul is None or not fuse(mlp.intermediate):
            return False
        mlp.gate_up_silu = silu_mul
    return True


def set_fused_ops(model: nn.Module, on: bool) -> list[str]:
    """Set the kernel switch of every module that has one (the tests and benchmarks/layer_ops.py
    turn it off again); returns the kinds of op found."""
    kinds: set[str] = set()
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.fused = on
            kinds.add("rms_norm")
        elif isinstance(module, GatedMLP) and module.activation in ("silu", "swish"):
            module.fused = on
            kinds.add("silu_mul")
            if on and fuse_into_product(module):
                kinds.add("silu_mul in the gate/up product")
        elif isinstance(module, Attention):
            module.fused_rope = on
            kinds.add("rope")
    return sorted(kinds)
