"""Moving a request's KV cache between engine instances (live migration, prefill/decode hand-off).

- `transport.py`: how bytes get from one engine process to another (ZeroMQ over tcp:// or ipc://,
  or a same-host shared-memory segment with ZeroMQ carrying only the header).
- `wire.py`: the messages engines exchange about a transfer.
- `sender.py` / `receiver.py`: the two ends of a transfer inside an engine loop (staged copy,
  stop-and-copy, hand-over; preallocated blocks, install, cancel, timeouts).
"""
