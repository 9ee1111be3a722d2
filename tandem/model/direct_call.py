"""A cheaper call for the modules a decoder step calls hundreds of times."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn


class DirectCall:
    """Calling the module runs its forward straight away.

    `nn.Module.__call__` first checks for hooks and tracing or compile state, about 2 us a call;
    a decode step of a 24-layer model makes some 200 such calls (norms, projections, attention,
    MLP, the layers themselves), a tenth of a one-stream step's time outside the matrix products.
    Tandem registers no hooks on its modules. Listed before `nn.Module` among the bases.
    """

    forward: Callable[..., Any]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)


def bind_submodules(model: nn.Module) -> None:
    """Make each module's submodules plain instance attributes, after loading has swapped in
    every layer it will (quantized and packed linears, 4-bit layers, fused experts).

    `self.qkv_proj` on an `nn.Module` misses the instance dictionary and goes through
    `nn.Module.__getattr__` (about 1 us; some 250 lookups a decode step of a 24-layer model). A
    copy in the instance dictionary is found first. Assigning a module attribute later still
    works: `nn.Module.__setattr__` drops the copy and registers the new module, whose lookups then
    take the slow path again. Parameters are left alone (`.to()` may replace them).
    """
    for module in model.modules():
        for name, sub in module._modules.items():
            if sub is not None and not hasattr(type(module), name):
                module.__dict__[name] = sub


class BoundTensors:
    """A layer's tensors that forward reads, as one plain tuple (`self._tensors`).

    Buffers and parameters are found by `nn.Module.__getattr__` (about 1 us each; a quantized
    product reads four or five a call, a third of a one-row product's cost outside its kernel).
    The tuple lists `_bound` in order; `_apply` (`.to()` and the like, which replace the tensors)
    rebinds it. Listed before `nn.Module` among the bases; call `bind_tensors()` once the tensors
    are set.
    """

    _bound: tuple[str, ...] = ()

    def bind_tensors(self) -> None:
        self.__dict__["_tensors"] = tuple(getattr(self, name) for name in self._bound)

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> Any:
        result = super()._apply(fn, recurse)  # type: ignore[misc]
        self.bind_tensors()
        return result
