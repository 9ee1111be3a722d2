"""Property-based fuzzing of a running server's HTTP API from its own /openapi.json (schemathesis).

For every operation, seeded valid and invalid requests (schemathesis' positive and negative
modes); `check(label, response)` sees each response. Used by the hardening tests and by
benchmarks/reliability.py. Needs the `schemathesis` package (a dev dependency).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any


def fuzz_openapi(base_url: str, examples: int, check: Callable[[str, Any], None]) -> int:
    """Send up to `examples` requests per operation and mode; returns how many were sent."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis.core.result import Err
    from schemathesis.generation import GenerationMode

    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    sent = 0

    def run_operation(op: Any, mode: Any) -> None:
        label = f"{op.label} {mode.value}"

        @settings(
            max_examples=examples,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=op.as_strategy(mode))
        def run(case: Any) -> None:
            nonlocal sent
            sent += 1
            check(label, case.call(base_url=base_url, timeout=60))

        with contextlib.suppress(Unsatisfiable):  # nothing invalid to send to this operation
            run()

    for result in schema.get_all_operations():
        if isinstance(result, Err):  # an operation the schema describes badly
            raise result.err()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            run_operation(result.ok(), mode)
    return sent
