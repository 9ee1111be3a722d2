"""A cheaper call for the modules a decoder step calls hundreds of times."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


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
