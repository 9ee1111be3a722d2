"""The front end as two queues in a row: the API process takes the engines' output messages one at
a time, and the client reads the tokens of its streams one at a time.

Every engine step ends in one output message with the tokens its rows made. The API process works
through the messages in the order they come, spending the cost model's per-message CPU on each and
its per-token CPU on each token in turn; a token then goes to the client, a process of its own,
which spends its per-token CPU on each token it reads (and its per-message CPU once per message),
in the order they come out of the API process. A token reaches its client once both are through
it, plus the rest of the delivery (the HTTP hop), which does not queue. So a message of one token
at an idle front end takes `delivery_seconds`, as measured at light load; under load messages are
larger and wait for each other, as the client's time after the server's first token grows with the
load on a real server. A cost model without front-end figures gives every token `delivery_seconds`.
"""

from __future__ import annotations

from tandem.sim.cost import CostModel


class FrontEnd:
    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.cpu = cost.front_end_cpu()
        c = self.cpu
        one_token = c.api_message_s + c.api_token_s + c.client_message_s + c.client_token_s
        # The delivery a one-token message at an idle front end takes, less its CPU work: the hop.
        self.hop_s = max(0.0, cost.delivery_seconds() - one_token)
        self.api_free_at = 0.0
        self.client_free_at = 0.0

    def deliver(self, now: float, tokens: int, slowdown: float = 1.0) -> list[float]:
        """When each of the `tokens` tokens of a message arriving at `now` reaches its client, in
        the message's order; `slowdown` stretches the front end's CPU work (a host shared with busy
        instances), not the hop, which is mostly waiting. Without CPU figures the whole delivery
        stretches."""
        if not self.cpu.measured:
            return [now + self.cost.delivery_seconds() * slowdown] * tokens
        if tokens <= 0:
            return []
        c = self.cpu
        api = max(now, self.api_free_at) + c.api_message_s * slowdown
        client = self.client_free_at
        first = True
        times: list[float] = []
        for _ in range(tokens):
            api += c.api_token_s * slowdown
            client = max(client, api) + (c.client_message_s if first else 0.0) * slowdown
            client += c.client_token_s * slowdown
            first = False
            times.append(client)
        self.api_free_at, self.client_free_at = api, client
        return [t + self.hop_s for t in times]
