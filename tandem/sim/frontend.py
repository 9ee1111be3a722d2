"""The front end as a queue: the API process (and the client reading its stream) takes the engines'
output messages one at a time.

Every engine step ends in one output message with the tokens its rows made. The front end works
through the messages in the order they come, spending the cost model's `front_end_seconds(n)` on
a message of n tokens (so much per message, so much per token), and a token reaches its client once
the front end is through it and the tokens before it in its message, plus the rest of the delivery
(the HTTP hop), which does not queue. A message of one token at an idle front end therefore takes
`delivery_seconds`, as measured at light load; under load the messages are larger and wait for
each other, as the client's time after the server's first token grows with the load on a real
server. A cost model without front-end figures gives every token `delivery_seconds` alone.
"""

from __future__ import annotations

from tandem.sim.cost import CostModel


class FrontEnd:
    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.queued = cost.front_end_seconds(1) > 0
        # What a one-token message at an idle front end leaves of the measured delivery.
        self.hop_s = max(0.0, cost.delivery_seconds() - cost.front_end_seconds(1)) if self.queued else 0.0
        self.free_at = 0.0  # when the front end is through the messages it has

    def deliver(self, now: float, tokens: int, slowdown: float = 1.0) -> list[float]:
        """When each of the `tokens` tokens of a message arriving at `now` reaches its client, in
        the message's order; `slowdown` stretches the front end's work (a host shared with busy
        instances)."""
        if not self.queued:
            return [now + self.cost.delivery_seconds() * slowdown] * tokens
        if tokens <= 0:
            return []
        start = max(now, self.free_at)
        hop = self.hop_s * slowdown
        times = [start + self.cost.front_end_seconds(j) * slowdown + hop for j in range(1, tokens + 1)]
        self.free_at = start + self.cost.front_end_seconds(tokens) * slowdown
        return times
