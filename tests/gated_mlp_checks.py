"""A check shared by the gate/up fusion tests (AMX tiles, bfloat16 panels)."""

from __future__ import annotations

import torch

from tandem.model.fused_ops import fuse_into_product
from tandem.model.layers import GatedMLP
from tandem.model.linear import pack_linears


def assert_mlp_runs_activation_in_product(hidden: int, intermediate: int, x: torch.Tensor, second_copy: bool) -> None:
    """A bfloat16 gated MLP whose gate/up layer took the fused layout answers as its unfused twin,
    through the kernels and through PyTorch's operators."""
    torch.manual_seed(7)
    mlp = GatedMLP(hidden, intermediate).to(torch.bfloat16)
    twin = GatedMLP(hidden, intermediate).to(torch.bfloat16)
    twin.load_state_dict(mlp.state_dict())
    for m in (mlp, twin):
        pack_linears(m, second_copy=second_copy)
        m.fused = True
    assert fuse_into_product(mlp) and mlp.gate_up_silu is not None
    assert twin.gate_up_silu is None
    assert torch.equal(mlp(x), twin(x))
    mlp.fused = twin.fused = False  # the PyTorch operators again: the layer's plain answer
    assert torch.equal(mlp(x), twin(x))
