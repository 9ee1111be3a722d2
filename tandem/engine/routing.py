"""Which instance runs each request, as the front end keeps it: where a new request goes
(tandem/engine/placement.py), the route table (routes, runs, moves: tandem/kvtransfer/routes.py),
each request as first sent (to send it again elsewhere), and the dispatcher's bookkeeping of what
runs where.
"""

from __future__ import annotations

from dataclasses import replace

from tandem.core.engine_io import EngineCoreRequest, SampleOutput
from tandem.engine import messages as m
from tandem.engine.instances import Instances
from tandem.engine.placement import Disaggregation, DispatchHook, place, resume_targets
from tandem.kvtransfer.routes import LiveMove, Routes


class Router:
    def __init__(self, instances: Instances, disaggregation: Disaggregation | None = None) -> None:
        self.instances = instances
        self.disaggregation = disaggregation
        self.dispatcher: DispatchHook | None = None
        self.table = Routes()
        # request id -> the request as last sent (to resume it elsewhere if its instance dies)
        self.requests: dict[str, EngineCoreRequest] = {}

    def place(self, req: EngineCoreRequest) -> tuple[int, int | None]:
        """Where a new request runs, and (prefill/decode) the decode instance it is handed to."""
        inst = self.instances
        return place(req, self.dispatcher, self.disaggregation, inst.dispatchable, inst.live)

    def resume_target(self, req: EngineCoreRequest) -> int:
        """Where a request resumed by recompute goes (ValueError if nowhere)."""
        targets = resume_targets(self.disaggregation, self.instances.dispatchable, self.instances.live)
        if self.dispatcher is not None:
            return self.dispatcher.choose(req, targets)
        if not targets:
            raise ValueError("no engine instance is running")
        return min(targets)

    def send(self, req: EngineCoreRequest, instance: int) -> None:
        """Send `req` to `instance`, as the request's next run, and record that it runs there
        (EngineDeadError, after recording, if the instance cannot be reached)."""
        req = replace(req, incarnation=self.table.next_run(req.request_id))
        payload = self.instances.encode(m.Add(req))
        self.table.route(req.request_id, instance)
        self.requests[req.request_id] = req
        if self.dispatcher is not None:
            self.dispatcher.routed(req, instance)
        self.instances.send(instance, payload)

    def moved(self, request_id: str, move: LiveMove) -> list[SampleOutput]:
        """A move completed: the request runs on its destination now; returns its held outputs."""
        held = self.table.complete(request_id, move)
        req = self.requests.get(request_id)
        if req is not None:
            req = self.requests[request_id] = replace(req, incarnation=move.incarnation)
            if self.dispatcher is not None:
                self.dispatcher.release(request_id)
                self.dispatcher.routed(req, move.destination)
        return held

    def forget(self, request_id: str) -> tuple[int | None, LiveMove | None]:
        """The request ended: nothing is kept of it. Returns the instance it ran on and its move
        under way."""
        self.requests.pop(request_id, None)
        if self.dispatcher is not None:
            self.dispatcher.release(request_id)
        return self.table.forget(request_id)

    def instance_gone(self, instance: int) -> None:
        if self.dispatcher is not None:
            self.dispatcher.forget_instance(instance)
