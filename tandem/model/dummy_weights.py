"""`load_format="dummy"` (vLLM's name): random weights of a config's shape, made where they will run.

For benchmarks of shapes whose checkpoints would be many gigabytes (an 8B model is 16 GB in
bfloat16): the folder needs only config.json (and a tokenizer for the front end). Each parameter is
drawn in its final dtype directly on the device from one generator seeded with the engine's seed,
in the model's parameter order, so the same seed, shape, dtype and device give the same weights.

Matrices and embeddings ~ N(0, 0.02) (transformers' `initializer_range`), norm weights at their
identity (1, or 0 where the norm multiplies by 1 + weight: Gemma), biases 0. The outputs mean
nothing; the activations keep a sane scale through the layers, which is all a timing needs.
"""

from __future__ import annotations

import torch
from torch import nn

INIT_STD = 0.02


@torch.no_grad()
def fill_dummy_weights(module: nn.Module, seed: int, norm_offset: bool = False) -> None:
    """Overwrite every parameter and floating buffer of `module` (materialised, e.g. by `to_empty`)."""
    params = list(module.named_parameters())
    if not params:
        return
    device = params[0][1].device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in params:
        leaf = name.rsplit(".", 1)[-1]
        if p.dim() >= 2:
            p.normal_(0.0, INIT_STD, generator=gen)
        elif "norm" in name and leaf == "weight":
            p.fill_(0.0 if norm_offset else 1.0)
        else:
            p.zero_()
    for _, b in module.named_buffers():
        if b.is_floating_point():
            b.zero_()
