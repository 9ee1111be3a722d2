"""Moving a request's KV cache between engine instances (live migration, prefill/decode hand-off).

- `protocol.py`: the migration protocol in one place: every message of a move (front end <->
  engines, engine <-> engine), the source's states with their transition table, the outcomes.
- `host.py`: `KVHost`, all the plane asks of the engine it runs in (EngineCore implements it).
- `transport.py`: how bytes get from one engine process to another (ZeroMQ over tcp:// or ipc://,
  or a same-host shared-memory segment with ZeroMQ carrying only the header).
- `sender.py` / `receiver.py`: the two ends of a transfer (staged copy while the request decodes,
  stop-and-copy, hand-over; reservations, install, cancel, timeouts).
- `plane.py`: an engine's inbox and both ends over it, driven by the engine loop.
- `routes.py`: the front end's half of a move (routes, runs, held outputs), one table for the
  server's engine client, the cluster simulator and the tests' cluster harness.

Nothing here imports `tandem.engine`: the engine hosts the plane, not the other way round.
"""
