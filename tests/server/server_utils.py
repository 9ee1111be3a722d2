"""Start `tandem serve` as a subprocess on a free local port, talk to it, stop it."""

from __future__ import annotations

from typing import Any

from tandem.loadgen.server_process import ServerProcess, free_port

try:  # the openai client ships with httpx2; plain httpx works the same
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

__all__ = ["FAST_ARGS", "RemoteServer", "free_port", "httpx"]

# Small and fast: a tiny KV cache, a few sequences.
FAST_ARGS = ["--num-kv-blocks", "128", "--max-num-seqs", "8", "--num-threads", "1"]


class RemoteServer(ServerProcess):
    """A server process plus the clients the tests talk to it with."""

    def client(self, api_key: str = "unused", **kw: Any):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60, **kw)

    def http(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kw)

    def __enter__(self) -> RemoteServer:
        return self
