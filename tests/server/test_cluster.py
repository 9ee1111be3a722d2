"""Several engine instances on Ray behind one server, with live migration on imbalance: outputs
equal the single engine's, requests are spread over the instances, draining an instance moves its
running requests (KV and all) to the others and shuts it down without a client noticing, and an
instance killed mid-decode (SIGKILL of its actor process) costs the clients nothing: its requests
resume on another instance from the tokens streamed so far. With no instance left, requests get a
clear error and the server exits non-zero.

One server (its own local Ray cluster) for the module; the suite's only Ray start.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from server_utils import RemoteServer

from tandem import LLM, SamplingParams

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

PROMPTS = [[5, 9, 11, 13], [21, 22, 23], [30, 31, 32, 33, 34], [40, 41], [50, 52, 54], [60, 61, 62, 63, 64]]
BODY = {"model": "tiny", "temperature": 0, "ignore_eos": True}
# Requests that must still be decoding when the test acts on them (a drain, a kill) are held there by
# their length: load reports are up to 0.2 s old, and on a fast machine 1000 tokens of the tiny model
# take about half a second, so the module's checkpoint holds 4096 positions and they run 3000 tokens.
LONG_TOKENS = 3000
# Tokens each request decodes on average before the drain: past the 2 full blocks of 4
# (`migration_stop_blocks`, `--block-size 4`) a move copies in stages.
STAGED_TOKENS = 16
# How long a client waits for a whole (non-streamed) answer: the tests bound their work, not the
# machine's speed (a loaded machine decodes 3000 tokens of a batch for minutes).
ANSWER_TIMEOUT_S = 900
ADMIN_KEY = "operator-key"


@pytest.fixture(scope="module")
def long_dir(model_factory):
    return model_factory("llama", max_position_embeddings=4096)


@pytest.fixture(scope="module")
def server(long_dir):
    # 2560 blocks of 4: after the drain, two instances hold three of its requests each.
    args = ["--num-instances", "3", "--num-threads", "1", "--num-kv-blocks", "2560", "--max-num-seqs", "4"]
    args += ["--served-model-name", "tiny", "--dispatch-policy", "least_load", "--block-size", "4"]
    args += ["--migration-triggers", "imbalance", "--cpus-per-instance", "0.5"]
    args += ["--admin-api-key", ADMIN_KEY]
    with RemoteServer(long_dir, *args, startup_timeout=300) as s:
        yield s
        s.stop()  # drain: the instances' Ray actors go down with the server


@pytest.fixture(scope="module")
def offline(long_dir):
    return LLM(str(long_dir), num_kv_blocks=1024, num_threads=1, block_size=4)


@pytest.fixture(scope="module")
def expected(offline):
    """The single engine's text for (prompt, max_tokens), each computed once for the module."""
    texts: dict[tuple[tuple[int, ...], int], str] = {}

    def text(prompt: list[int], max_tokens: int) -> str:
        key = (tuple(prompt), max_tokens)
        if key not in texts:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            out = offline.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
            texts[key] = out.outputs[0].text
        return texts[key]

    return text


def instance_pids() -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if b"EngineInstance" in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                pass
    return sorted(pids)


def post_all(server, max_tokens: int, results: dict, prompts=PROMPTS) -> list[threading.Thread]:
    def send(i: int, prompt: list[int]) -> None:
        body = {**BODY, "prompt": prompt, "max_tokens": max_tokens}
        with server.http() as http:
            results[i] = http.post("/v1/completions", json=body, timeout=ANSWER_TIMEOUT_S)

    threads = [threading.Thread(target=send, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    return threads


def test_outputs_equal_the_single_engine_and_spread_over_instances(server, expected):
    results: dict = {}
    for t in post_all(server, 16, results):
        t.join(ANSWER_TIMEOUT_S)
    for i, prompt in enumerate(PROMPTS):
        assert results[i].status_code == 200, results[i].text
        assert results[i].json()["choices"][0]["text"] == expected(prompt, 16)
    m = server.metrics()
    dispatched = [m[f'tandem:instance_requests_dispatched{{instance="{i}"}}'] for i in (0, 1, 2)]
    assert sum(dispatched) >= len(PROMPTS) and min(dispatched) >= 1, dispatched
    assert len(instance_pids()) == 3


def running(server) -> dict[int, float]:
    """Requests running on each instance, as its last load report says."""
    m = server.metrics()
    key = 'tandem:instance_num_requests_running{{instance="{}"}}'
    return {i: m[key.format(i)] for i in (0, 1, 2) if key.format(i) in m}


def test_draining_an_instance_moves_its_requests_live_and_retires_it(server, expected):
    results: dict = {}
    # The imbalance trigger moves some requests around meanwhile, so the instances seldom report
    # all six running at once. The drained instance is whichever runs the most requests once all
    # six are prefilled, as the instances' reports count prompt tokens (so every load report read
    # then was sent after its instance took its share: an older one can still show a request of the
    # previous test), so the test does not depend on where the dispatcher put them.
    # The drain waits, too, until the requests have decoded past `migration_stop_blocks` full blocks
    # on average: a request with fewer new blocks is paused and copied at once (no stage to copy
    # while it decodes), which is what a move made right after a prompt does, however fast the
    # machine.
    before = server.metrics()
    prefilled = before["tandem:prompt_tokens_total"] + sum(len(p) for p in PROMPTS)
    decoded = before.get("tandem:generation_tokens_total", 0) + len(PROMPTS) * STAGED_TOKENS
    threads = post_all(server, LONG_TOKENS, results)
    deadline = time.monotonic() + 60
    load = running(server)

    def ready() -> bool:
        m = server.metrics()
        return (
            m["tandem:prompt_tokens_total"] >= prefilled
            and m.get("tandem:generation_tokens_total", 0) >= decoded
            and max(load.values(), default=0) > 0
        )

    while time.monotonic() < deadline and not ready():
        time.sleep(0.01)
        load = running(server)
    victim = max(load, key=lambda i: load[i])
    assert load[victim] > 0, load
    with server.http() as http:
        # An operator route: without the admin key nothing is drained.
        assert http.post(f"/admin/instances/{victim}/drain").status_code == 401
    with server.http(headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as http:
        resp = http.post(f"/admin/instances/{victim}/drain", timeout=ANSWER_TIMEOUT_S)
        assert resp.status_code == 200, resp.text
        assert http.post(f"/admin/instances/{victim}/drain").status_code == 409  # not running any more
    for t in threads:
        t.join(ANSWER_TIMEOUT_S)
    for i, prompt in enumerate(PROMPTS):
        assert results[i].status_code == 200, results[i].text
        assert results[i].json()["choices"][0]["text"] == expected(prompt, LONG_TOKENS), i
    m = server.metrics()
    outcomes = {k: v for k, v in m.items() if k.startswith("tandem:migrations_total")}
    dispatched = [m[f'tandem:instance_requests_dispatched{{instance="{i}"}}'] for i in (0, 1, 2)]
    assert m.get('tandem:migrations_total{outcome="completed"}', 0) >= 1, (outcomes, dispatched, load)
    assert m["tandem:kv_transfer_bytes_total"] > 0
    assert m["tandem:migrations_started"] >= m['tandem:migrations_total{outcome="completed"}']
    assert m["tandem:migration_downtime_seconds_count"] >= 1
    # The drain's moves copied their context in stages while the requests decoded (a move the
    # imbalance trigger made right after a prompt may have had nothing to stage: 0 stages).
    staged = m["tandem:migration_stages_count"] - m.get('tandem:migration_stages_bucket{le="0.0"}', 0)
    assert staged >= 1, {k: v for k, v in m.items() if k.startswith("tandem:migration_stages")}
    deadline = time.monotonic() + 30
    while len(instance_pids()) != 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(instance_pids()) == 2
    assert victim not in running(server)  # its last report no longer counts


def test_killing_an_instance_mid_decode_costs_the_clients_nothing(server, expected):
    results: dict = {}
    # Eight requests: both instances the drain left run four each (`--max-num-seqs 4`; least_load
    # alternates them), all at once, for 3000 tokens: whichever instance dies holds running requests
    # when it does, however fast the machine, and the survivor's work afterwards is two waves.
    prompts = (PROMPTS + PROMPTS)[:8]
    threads = post_all(server, LONG_TOKENS, results, prompts)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if sum(n > 0 for n in running(server).values()) >= 2:  # both instances the drain left
            break
        time.sleep(0.05)
    victim = instance_pids()[0]
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(ANSWER_TIMEOUT_S)
    for i, prompt in enumerate(prompts):
        assert results[i].status_code == 200, results[i].text
        assert results[i].json()["choices"][0]["text"] == expected(prompt, LONG_TOKENS), i
    assert server.metrics()["tandem:requests_resumed"] >= 1
    assert victim not in instance_pids()
    # The survivor goes on serving new requests.
    with server.http() as http:
        assert http.get("/health").status_code == 200
        resp = http.post("/v1/completions", json={**BODY, "prompt": PROMPTS[0], "max_tokens": 8})
        assert resp.json()["choices"][0]["text"] == expected(PROMPTS[0], 8)


def test_with_no_instance_left_requests_fail_clearly_and_the_server_exits(server):
    results: dict = {}
    threads = post_all(server, LONG_TOKENS, results, PROMPTS[:2])
    deadline = time.monotonic() + 60
    while server.metrics()["tandem:num_requests_running"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in instance_pids():
        os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(ANSWER_TIMEOUT_S)
    assert len(results) == 2
    for r in results.values():
        assert r.status_code == 500
        assert r.json()["error"]["code"] == "engine_dead"
    assert server.proc.wait(60) == 1
