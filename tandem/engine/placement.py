"""Where a request runs among engine instances, decided in one place for the server's front end
(tandem/engine/core_client.py) and the cluster simulator (tandem/sim/simulator.py).

- `Disaggregation`: the instances' prefill/decode roles (`roles` makes them from the cluster's
  prefill and decode counts: the first ones prefill, the rest decode).
- `place`: a new request goes where the dispatcher chooses among the instances that take new
  requests (not draining). With roles, a prompt of at least `min_prompt_tokens` tokens is
  prefilled on a prefill instance and handed at its first token to the least loaded decode
  instance; a shorter one, or any when no prefill instance is left, runs wholly on a decode
  instance; with no decode instance left the prefill instances do everything.
- `resume_targets`, `decode_target`: where a request resumed by recompute goes (a decode instance
  under roles), and where a failed hand-off falls back to.

The dispatcher is reached through `DispatchHook` (tandem.cluster.dispatch.Dispatcher implements it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tandem.core.engine_io import EngineCoreRequest
from tandem.engine.messages import Stats


class DispatchHook(Protocol):
    """What placement and the front end need of a dispatcher across instances."""

    num_dispatched: list[int]

    def choose(self, req: EngineCoreRequest, live: set[int]) -> int: ...

    def routed(self, req: EngineCoreRequest, instance: int) -> None: ...

    def release(self, request_id: str) -> None: ...

    def least_loaded(self, candidates: set[int]) -> int: ...

    def observe(self, instance: int, stats: Stats) -> None: ...

    def forget_instance(self, instance: int) -> None: ...


@dataclass(frozen=True, slots=True)
class Disaggregation:
    """Prefill/decode roles of the instances: a new request with at least `min_prompt_tokens`
    prompt tokens is prefilled on a prefill instance and handed to a decode instance at its first
    token; a shorter one runs wholly on a decode instance."""

    prefill: frozenset[int]
    decode: frozenset[int]
    min_prompt_tokens: int = 0


def roles(prefill_instances: int, decode_instances: int, min_prompt_tokens: int = 0) -> Disaggregation | None:
    """Instances 0..P-1 prefill, P..P+D-1 decode; None without prefill instances (no roles)."""
    if prefill_instances <= 0:
        return None
    p, d = prefill_instances, decode_instances
    return Disaggregation(frozenset(range(p)), frozenset(range(p, p + d)), min_prompt_tokens)


def place(
    req: EngineCoreRequest,
    dispatcher: DispatchHook | None,
    pd: Disaggregation | None,
    dispatchable: set[int],
    live: set[int],
) -> tuple[int, int | None]:
    """Where a new request runs, and (prefill/decode) the decode instance it is handed to.
    `dispatchable`: the live instances that take new requests (not draining)."""
    if dispatcher is None:
        return 0, None
    if pd is None:
        return dispatcher.choose(req, dispatchable), None
    decode = dispatchable & set(pd.decode)
    prefill = dispatchable & set(pd.prefill)
    if not decode:  # no decode instance left: the prefill instances do everything
        return dispatcher.choose(req, prefill or live), None
    if not prefill or len(req.prompt_token_ids) < pd.min_prompt_tokens:
        return dispatcher.choose(req, decode), None
    return dispatcher.choose(req, prefill), dispatcher.least_loaded(decode)


def resume_targets(pd: Disaggregation | None, dispatchable: set[int], live: set[int]) -> set[int]:
    """Where a request resumed by recompute may go: a decode instance under roles (its prefill is
    done, or lost), else any that takes new requests, else any live one."""
    return set(pd.decode & dispatchable if pd else ()) or dispatchable or live


def decode_target(preferred: int, pd: Disaggregation | None, dispatchable: set[int], live: set[int]) -> int:
    """`preferred` if it lives, else another live decode instance (any live one without)."""
    if preferred in live:
        return preferred
    targets = resume_targets(pd, dispatchable, live)
    return min(targets) if targets else preferred
