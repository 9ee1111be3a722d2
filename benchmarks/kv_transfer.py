#!/usr/bin/env python
"""Moving a request's KV blocks between two processes on this host, with each candidate transport.

One message per request: a (layers, 2, blocks, block_size, kv_heads, head_dim) tensor, sized for
the default model (or `--model`) at 16, 128, 1024 and 4096 tokens in bfloat16, plus one 64 MiB
message. The receiver copies each payload into a preallocated tensor, as an engine does, and only
then stamps it. Candidates:

- zmq-tcp / zmq-ipc: Tandem's KVTransport (tandem/kvtransfer/transport.py) over tcp://127.0.0.1
  and ipc://;
- shm: Tandem's ShmTransport (a shared-memory segment per message, ZeroMQ over ipc for the name);
- ray: the driver `ray.put`s the bytes and calls an actor that `ray.get`s and copies them;
- mooncake-tcp: Mooncake's transfer engine, TCP protocol, P2PHANDSHAKE metadata (no etcd, no
  RDMA): the sender writes straight into the receiver's registered destination tensor (so there is
  no receive-side copy), then tells it over ZeroMQ. Skipped, with the reason, where it cannot run.

    python benchmarks/kv_transfer.py                     # writes benchmarks/results/kv_transfer.json
    python benchmarks/kv_transfer.py --quick --candidates zmq-ipc,shm
    python benchmarks/kv_transfer.py --mooncake-path DIR # where `pip install --target DIR
                                                         #   mooncake-transfer-engine-non-cuda` put it

One-way latency: the receiver's `time.perf_counter()` once the copy is done, minus the sender's
before it sent (on Linux both read CLOCK_MONOTONIC, one clock for every process); one message at a
time, the next after the receiver's acknowledgement. Throughput: bytes / median one-way latency
(no pipelining). Loopback only, so tcp here measures memory copies and the kernel's TCP stack, not
a network; the sender, the receiver and (for Ray) its daemons share this machine's cores.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import multiprocessing
import os
import platform
import shlex
import shutil
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.cpu import cpu_model
from tandem.kvtransfer.transport import KVTransport, Message, make_transport

CANDIDATES = ("zmq-tcp", "zmq-ipc", "shm", "ray", "mooncake-tcp")
TOKENS = (16, 128, 1024, 4096)
LARGE_BYTES = 64 * 1024 * 1024
BLOCK_SIZE = 16
# (case index, sequence number, perf_counter timestamp): a message's header and its acknowledgement.
HEADER = struct.Struct("<iid")
STOP = b"stop"
WAIT_S = 60.0


@dataclass(frozen=True)
class Case:
    label: str
    tokens: int
    shape: tuple[int, ...]
    nbytes: int
    fp32_nbytes: int


def kv_cases(model_dir: Path) -> list[Case]:
    cfg = json.loads((model_dir / "config.json").read_text())
    layers, kv_heads = cfg["num_hidden_layers"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_block = layers * 2 * BLOCK_SIZE * kv_heads * head_dim  # elements
    large_blocks = LARGE_BYTES // (per_block * 2)
    cases = []
    for tokens in (*TOKENS, large_blocks * BLOCK_SIZE):
        blocks = -(-tokens // BLOCK_SIZE)
        label = f"{tokens} tok" if tokens in TOKENS else "64 MiB"
        shape = (layers, 2, blocks, BLOCK_SIZE, kv_heads, head_dim)
        cases.append(Case(label, tokens, shape, blocks * per_block * 2, blocks * per_block * 4))
    return cases


def reps_for(nbytes: int, quick: bool) -> int:
    """Enough round trips for a stable median, few enough for big messages to stay quick."""
    most, least = (20, 5) if quick else (100, 10)
    return max(least, min(most, (256 << 20) // nbytes))


def byte_view(t: torch.Tensor) -> np.ndarray:
    """A tensor's memory as flat uint8 numpy (bfloat16 has no numpy dtype)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def make_sources(cases: list[Case]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(c.shape, generator=gen).to(torch.bfloat16) for c in cases]


def make_destinations(cases_shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    return [byte_view(torch.empty(shape, dtype=torch.bfloat16)) for shape in cases_shapes]


def digest(buf: Any) -> str:
    return hashlib.blake2b(buf, digest_size=16).hexdigest()


def wait_message(transport: KVTransport, timeout: float = WAIT_S) -> Message:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = transport.recv()
        if msg is not None:
            return msg
        transport.socket.poll(100)
    raise TimeoutError(f"no message within {timeout:.0f} s")


def failure(exc: BaseException) -> RuntimeError:
    """An exception to send back to the parent (the original may not pickle)."""
    return RuntimeError(f"in the receiver: {type(exc).__name__}: {exc}")


def recv_conn(conn: Any, timeout: float = WAIT_S) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"the receiver process said nothing within {timeout:.0f} s")
    reply = conn.recv()
    if isinstance(reply, BaseException):
        raise reply
    return reply


def bind_for(scheme: str, tmpdir: str, name: str) -> str:
    return "tcp://127.0.0.1" if scheme == "tcp" else f"ipc://{tmpdir}/{name}"


# -- receivers (each in a spawned process) -------------------------------------------------------


def acknowledge(inbox: KVTransport, reply_to: str, on_message: Callable[[int, Message], None]) -> None:
    """Until STOP: hand each message to `on_message`, release it, and send back the time it was done."""
    while True:
        msg = wait_message(inbox)
        if msg.header == STOP:
            msg.release()
            return
        case, seq, _ = HEADER.unpack(msg.header)
        on_message(case, msg)
        msg.release()
        inbox.send(reply_to, HEADER.pack(case, seq, time.perf_counter()))


def transport_receiver(kind: str, bind: str, reply_to: str, shapes: list, threads: int, conn: Any) -> None:
    torch.set_num_threads(threads)
    dsts = make_destinations(shapes)
    inbox = make_transport(kind, bind)
    try:
        conn.send(inbox.address)

        def copy_out(case: int, msg: Message) -> None:
            np.copyto(dsts[case], np.frombuffer(msg.payload or b"", np.uint8))

        acknowledge(inbox, reply_to, copy_out)
        conn.send([digest(d) for d in dsts])
    except Exception as exc:
        conn.send(failure(exc))
    finally:
        inbox.close()


def mooncake_receiver(reply_to: str, shapes: list, threads: int, conn: Any) -> None:
    torch.set_num_threads(threads)
    try:
        engine = mooncake_engine()
        dsts = make_destinations(shapes)
        for d in dsts:
            if engine.register_memory(d.ctypes.data, d.nbytes) != 0:
                raise RuntimeError("Mooncake register_memory failed on the receiver")
        inbox = make_transport("zmq", "tcp://127.0.0.1")
    except Exception as exc:
        conn.send(failure(exc))
        return
    try:
        rpc = f"127.0.0.1:{engine.get_rpc_port()}"
        conn.send((rpc, [d.ctypes.data for d in dsts], inbox.address))
        # The data is already in place when the notice comes: nothing to copy.
        acknowledge(inbox, reply_to, lambda case, msg: None)
        conn.send([digest(d) for d in dsts])
    except Exception as exc:
        conn.send(failure(exc))
    finally:
        inbox.close()


def mooncake_engine() -> Any:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # its INFO lines would bury the table
    # Imported by name: an optional package, absent from the project's dependencies.
    engine = importlib.import_module("mooncake.engine").TransferEngine()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"Mooncake TransferEngine.initialize(P2PHANDSHAKE, tcp) returned {rc}")
    return engine


def mooncake_package() -> str:
    from importlib import metadata

    for name in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


class RayReceiver:
    """The Ray actor: gets the object, copies it into the preallocated tensor, stamps the time."""

    def __init__(self, shapes: list, threads: int) -> None:
        torch.set_num_threads(threads)
        self.dsts = make_destinations(shapes)

    def take(self, case: int, refs: list) -> float:
        import ray

        np.copyto(self.dsts[case], ray.get(refs[0]))
        return time.perf_counter()

    def digests(self) -> list[str]:
        return [digest(d) for d in self.dsts]


# -- measuring -------------------------------------------------------------------------------------


def measure(
    cases: list[Case], send_one: Callable[[int, int], tuple[float, float, float]], quick: bool
) -> list[dict[str, Any]]:
    """Per case: warm-up, then round trips one at a time; `send_one(case, seq)` returns the sender's
    start, the receiver's done and the sender's acknowledged timestamps."""
    rows = []
    seq = 0
    for i, case in enumerate(cases):
        for _ in range(3):
            send_one(i, seq := seq + 1)
        one_way, round_trip = [], []
        for _ in range(reps_for(case.nbytes, quick)):
            start, done, acked = send_one(i, seq := seq + 1)
            one_way.append(done - start)
            round_trip.append(acked - start)
        rows.append(summarize(case, one_way, round_trip))
    return rows


def summarize(case: Case, one_way: list[float], round_trip: list[float]) -> dict[str, Any]:
    ordered = sorted(one_way)
    median = statistics.median(one_way)
    return {
        "case": case.label,
        "bytes": case.nbytes,
        "reps": len(one_way),
        "one_way_median_us": median * 1e6,
        "one_way_p10_us": ordered[len(ordered) // 10] * 1e6,
        "one_way_p90_us": ordered[(len(ordered) * 9) // 10] * 1e6,
        "round_trip_median_us": statistics.median(round_trip) * 1e6,
        "gb_per_s": case.nbytes / median / 1e9,
    }


def spawn(target: Callable, *args: Any) -> tuple[Any, Any]:
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, theirs), daemon=True)
    proc.start()
    return proc, ours


def stop(proc: Any) -> None:
    """Wait for a receiver that was told to stop; kill one that was not (a run that failed)."""
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


def run_transport(kind: str, scheme: str, cases: list[Case], sources: list[torch.Tensor], a: Any) -> dict:
    tmpdir = tempfile.mkdtemp(prefix="tandem-kvbench-")
    sender = make_transport(kind, bind_for(scheme, tmpdir, "sender"))
    shapes = [c.shape for c in cases]
    proc, conn = spawn(
        transport_receiver, kind, bind_for(scheme, tmpdir, "receiver"), sender.address, shapes, a.threads
    )
    try:
        peer = recv_conn(conn)

        def send_one(case: int, seq: int) -> tuple[float, float, float]:
            start = time.perf_counter()
            sender.send(peer, HEADER.pack(case, seq, start), sources[case])
            ack = wait_message(sender)
            acked = time.perf_counter()
            return start, HEADER.unpack(ack.header)[2], acked

        rows = measure(cases, send_one, a.quick)
        sender.send(peer, STOP)
        return {"status": "ok", "results": verified(rows, recv_conn(conn), sources)}
    finally:
        stop(proc)
        sender.close()
        shutil.rmtree(tmpdir, ignore_errors=True)


def run_ray(cases: list[Case], sources: list[torch.Tensor], a: Any) -> dict:
    try:
        import ray
    except ImportError as exc:
        return {"status": "skipped", "reason": f"ray is not installed ({exc})"}
    import logging

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.ERROR,
        object_store_memory=512 << 20,
    )
    try:
        receiver: Any = ray.remote(num_cpus=0)(RayReceiver).remote([c.shape for c in cases], a.threads)
        arrays = [byte_view(s) for s in sources]

        def send_one(case: int, seq: int) -> tuple[float, float, float]:
            start = time.perf_counter()
            ref = ray.put(arrays[case])
            done = ray.get(receiver.take.remote(case, [ref]))
            return start, done, time.perf_counter()

        rows = measure(cases, send_one, a.quick)
        return {
            "status": "ok",
            "ray_version": ray.__version__,
            "results": verified(rows, ray.get(receiver.digests.remote()), sources),
        }
    finally:
        ray.shutdown()


def run_mooncake(cases: list[Case], sources: list[torch.Tensor], a: Any) -> dict:
    try:
        engine = mooncake_engine()
    except Exception as exc:
        hint = "pip install mooncake-transfer-engine-non-cuda (needs libibverbs1), or --mooncake-path"
        return {"status": "skipped", "reason": f"{type(exc).__name__}: {exc} ({hint})"}
    for s in sources:
        if engine.register_memory(s.data_ptr(), s.nbytes) != 0:
            return {"status": "skipped", "reason": "Mooncake register_memory failed on the sender"}
    notices = make_transport("zmq", "tcp://127.0.0.1")
    proc, conn = spawn(mooncake_receiver, notices.address, [c.shape for c in cases], a.threads)
    try:
        target, dst_addrs, inbox = recv_conn(conn)

        def send_one(case: int, seq: int) -> tuple[float, float, float]:
            src = sources[case]
            start = time.perf_counter()
            rc = engine.transfer_sync_write(target, src.data_ptr(), dst_addrs[case], src.nbytes)
            if rc != 0:
                raise RuntimeError(f"Mooncake transfer_sync_write returned {rc}")
            notices.send(inbox, HEADER.pack(case, seq, start))
            ack = wait_message(notices)
            acked = time.perf_counter()
            return start, HEADER.unpack(ack.header)[2], acked

        rows = measure(cases, send_one, a.quick)
        notices.send(inbox, STOP)
        return {
            "status": "ok",
            "package": mooncake_package(),
            "results": verified(rows, recv_conn(conn), sources),
        }
    finally:
        stop(proc)
        notices.close()


def run_copy_only(cases: list[Case], sources: list[torch.Tensor], a: Any) -> dict:
    """The floor: the receiver's copy into its preallocated tensor alone, in one process."""
    dsts = make_destinations([c.shape for c in cases])

    def copy_one(case: int, seq: int) -> tuple[float, float, float]:
        start = time.perf_counter()
        np.copyto(dsts[case], byte_view(sources[case]))
        done = time.perf_counter()
        return start, done, done

    rows = measure(cases, copy_one, a.quick)
    return {"status": "ok", "results": verified(rows, [digest(d) for d in dsts], sources)}


def verified(rows: list[dict], digests: list[str], sources: list[torch.Tensor]) -> list[dict]:
    """Each row with whether the receiver's tensor ended up byte-identical to what was sent."""
    for row, got, src in zip(rows, digests, sources):
        row["verified"] = got == digest(byte_view(src))
    return rows


def run_candidate(name: str, cases: list[Case], sources: list[torch.Tensor], a: Any) -> dict:
    start = time.monotonic()
    try:
        if name == "zmq-tcp":
            result = run_transport("zmq", "tcp", cases, sources, a)
        elif name == "zmq-ipc":
            result = run_transport("zmq", "ipc", cases, sources, a)
        elif name == "shm":
            result = run_transport("shm", "ipc", cases, sources, a)
        elif name == "ray":
            result = run_ray(cases, sources, a)
        else:
            result = run_mooncake(cases, sources, a)
    except Exception as exc:  # one candidate's failure is a result, not the end of the run
        result = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
    result["seconds"] = time.monotonic() - start
    return result


# -- report --------------------------------------------------------------------------------------


def size_text(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB" if n >= 1 << 20 else f"{n / 1024:.0f} KiB"


def print_table(r: dict[str, Any]) -> None:
    columns = {"copy only": r["copy_only"], **r["candidates"]}
    ran = [n for n, c in columns.items() if c["status"] == "ok"]
    width = 26
    print(
        f"\nKV transfer between two processes, {r['machine']['cpu']} ({r['machine']['cores']} cores), loopback"
    )
    print("one-way latency, median us | GB/s = bytes / median one-way; copy only: the receiver's copy alone")
    print(f"{'case':<10}{'bf16':>9}{'fp32':>9}" + "".join(f"{n:>{width}}" for n in ran))
    for i, case in enumerate(r["cases"]):
        cells = []
        for n in ran:
            row = columns[n]["results"][i]
            mark = "" if row["verified"] else "!"
            cells.append(f"{row['one_way_median_us']:>9.0f} us {row['gb_per_s']:>6.2f} GB/s{mark:>1}")
        print(
            f"{case['label']:<10}{size_text(case['nbytes']):>9}{size_text(case['fp32_nbytes']):>9}  "
            + "".join(f"{c:>{width}}" for c in cells)
        )
    for n in ran:
        spread = ", ".join(
            f"{row['one_way_p10_us']:.0f}-{row['one_way_p90_us']:.0f}" for row in columns[n]["results"]
        )
        print(f"  {n} p10-p90 us: {spread}")
    for n, c in columns.items():
        if c["status"] != "ok":
            print(f"  {n}: {c['status']}: {c['reason']}")
    if any(not row["verified"] for n in ran for row in columns[n]["results"]):
        print("  ! the receiver's copy differed from what was sent")
    print("measured bf16; fp32 KV is the fp32 column's size (no separate run: bytes are bytes)")
    print("ran:", r["command_line"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    p.add_argument("--candidates", default=",".join(CANDIDATES))
    p.add_argument("--threads", type=int, default=1, help="torch threads in each process")
    p.add_argument("--quick", action="store_true", help="fewer round trips")
    p.add_argument("--mooncake-path", default=None, help="a folder to import Mooncake from")
    p.add_argument("--out", default="benchmarks/results/kv_transfer.json")
    a = p.parse_args(argv)
    unknown = set(a.candidates.split(",")) - set(CANDIDATES)
    if unknown:
        p.error(f"unknown candidates {sorted(unknown)}; choose from {', '.join(CANDIDATES)}")
    if a.mooncake_path:
        sys.path.insert(0, str(Path(a.mooncake_path).resolve()))  # spawned receivers inherit it
    torch.set_num_threads(a.threads)
    from tandem.entrypoints.llm import default_model_path

    model = Path(a.model or default_model_path())
    cases = kv_cases(model)
    sources = make_sources(cases)
    results: dict[str, Any] = {
        "command_line": shlex.join([sys.executable, *sys.argv]),
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            # The machine may be shared: what else was running shows here.
            "load_average_at_start": os.getloadavg()[0],
        },
        "model": "default" if a.model is None else model.name,
        "dtype": "bfloat16",
        "block_size": BLOCK_SIZE,
        "threads": a.threads,
        "method": (
            "one message at a time; one-way = receiver perf_counter after copying into a preallocated "
            "tensor (Mooncake: after the notice; its write lands in place) minus sender perf_counter "
            "before sending; gb_per_s = bytes / median one-way"
        ),
        "cases": [asdict(c) for c in cases],
        "copy_only": run_copy_only(cases, sources, a),
        "candidates": {},
    }
    for name in a.candidates.split(","):
        print(f"== {name}", flush=True)
        results["candidates"][name] = run_candidate(name, cases, sources, a)
    print_table(results)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
