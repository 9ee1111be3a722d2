"""Operator routes (`POST /admin/instances/N/drain`) take the operator's key, never a tenant's: with
no `--admin-api-key` they are off (404 whatever the caller sends, keys or none), and with one they
need exactly it. In-process: the app is driven as ASGI, its cluster replaced by a recording migrator.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tandem.entrypoints.openai.api_server import build_app
from tandem.entrypoints.openai.metrics import ServerMetrics
from tandem.entrypoints.openai.serving import ServerState
from tandem.entrypoints.openai.tenants import Tenants

TENANT_KEYS = {"tenant-key": {"tenant": "a"}}
ADMIN_KEY = "operator-secret"


class RecordingMigrator:
    def __init__(self) -> None:
        self.drained: list[int] = []

    async def drain(self, instance: int) -> float:
        self.drained.append(instance)
        return 0.5


def app_with(tenants: Tenants, admin_api_key: str | None) -> tuple[Any, RecordingMigrator]:
    state = ServerState(
        model_name="m",
        metrics=ServerMetrics("m"),
        tenants=tenants,
        max_waiting_requests=8,
        drain_timeout=1.0,
    )
    state.admin_api_key = admin_api_key
    state.migrator = RecordingMigrator()
    return build_app(state, None), state.migrator  # type: ignore[arg-type]  # no engine: lifespan never runs


def post(app: Any, path: str, key: str | None = None) -> tuple[int, dict]:
    """One POST through the ASGI app (its guard included); the status and the JSON body."""
    headers = [(b"content-length", b"0")]
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 1234),
        "server": ("127.0.0.1", 8000),
    }
    sent: list[dict] = []
    requests = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> dict:
        if requests:
            return requests.pop()
        await asyncio.sleep(3600)  # no disconnect while the route runs
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(asyncio.wait_for(app(scope, receive, send), timeout=10))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body)


DRAIN = "/admin/instances/1/drain"


@pytest.mark.parametrize("key", [None, "tenant-key", "wrong", ADMIN_KEY])
def test_without_an_admin_key_operator_routes_are_off(key):
    """Before, any tenant's key drained (and so shut down) an instance, and without API keys anyone could."""
    for tenants in (Tenants(TENANT_KEYS), Tenants()):
        app, migrator = app_with(tenants, admin_api_key=None)
        status, body = post(app, DRAIN, key)
        assert status == 404, body
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert "--admin-api-key" in body["error"]["message"]
        assert migrator.drained == []


@pytest.mark.parametrize("tenants", [Tenants(TENANT_KEYS), Tenants()], ids=["tenant keys", "no tenant keys"])
def test_operator_routes_take_the_admin_key_only(tenants):
    app, migrator = app_with(tenants, admin_api_key=ADMIN_KEY)
    for key in (None, "tenant-key", "wrong", ADMIN_KEY + "x"):
        status, body = post(app, DRAIN, key)
        assert status == 401, (key, body)
        assert body["error"]["type"] == "authentication_error"
    assert migrator.drained == []
    status, body = post(app, DRAIN, ADMIN_KEY)
    assert status == 200, body
    assert body == {"instance": 1, "drained": True, "seconds": 0.5}
    assert migrator.drained == [1]
