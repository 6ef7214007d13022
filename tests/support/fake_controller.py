"""A scripted stand-in for the controller's node API (`rolloutd.crds.node`), for the daemon's tests.

An in-process FastAPI app served by uvicorn on a free port, in its own thread (so the daemon under
test may run in the test's event loop or in a subprocess). It validates every request with the
wire models, checks the join token, hands out queued work items as leases, and records everything
it receives. Scripted behaviour: `cancel(aid)` (sent with the next heartbeat that lists it),
`repin`, `drain`, `results_script` (answers for successive /results calls: 503 = refused unseen,
"lose" = accepted but answered 503, so the daemon resends), `hold_next_lease` (the next /lease
blocks until `release_lease` is set), `stop()`/`start()` (a real outage on the same port).
Node-protocol features (`crds.node.FEATURES`): `features` names those served to a daemon that asks at
registration (none: an older controller, which ignores the parameter and answers 422 to a body field it does
not know, as its models forbid extra fields); beats carrying results are answered as /results answers, with
`beat_gap`; `fail_beat(hb)` may refuse a beat unseen (its status), `max_beat_body` refuses larger beats (413);
`beat_log` records each beat with its receive time, the leases live before it and its status; `refuse_tasks`
refuses (422) a results call holding a scored result of those tasks, as the real controller refuses an invalid one.

The real scheduler's rules it mirrors: attempt ids are unique per lease; a result is accepted only
for the attempt holding the lease, a duplicate comes back in `dropped`; returned work is re-queued.
Infrastructure results are recorded and resolve the item (no re-queue: the tests count them).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections import Counter
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rolloutd.crds.node import (
    BEAT_DELTAS,
    BEAT_RESULTS,
    FEATURES_PARAM,
    Heartbeat,
    HeartbeatResponse,
    Lease,
    LeaseRequest,
    LeaseResponse,
    RegisterRequest,
    RegisterResponse,
    ResultAck,
    ResultBatch,
    Result,
    ReturnRequest,
    TOKEN_SHARE,
    WORK_SHARE,
)
from rolloutd.crds.rolloutjob import RolloutJobSpec

from support.ports import free_port
from support.serve_thread import ThreadServer

P = "/apis/rolloutd.io/v1alpha1/namespaces/{ns}/rolloutjobs/{job_name}/nodes"  # the daemon names its job in the path


class FakeController:
    def __init__(self, spec: dict, *, token: str = "join-secret", job: str = "demo",
                 heartbeat_seconds: float = 0.2, lease_seconds: float = 30.0,
                 policy_version: Any = 7, backend: str = "http://127.0.0.1:9/llm") -> None:
        RolloutJobSpec.model_validate(spec)  # the tests' specs must be valid wire specs
        self.spec, self.token, self.job = spec, token, job
        self.heartbeat_seconds, self.lease_seconds = heartbeat_seconds, lease_seconds
        self.policy_version, self.backend = policy_version, backend
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cond = threading.Condition()
        # work
        self.queue: list[dict] = []                 # {"item", "prompt", "sample", "task"}
        self.leased: dict[str, dict] = {}           # aid → item (live leases)
        self.lease_log: list[Lease] = []            # every lease handed out
        self.attempts: Counter[int] = Counter()
        self._ids = itertools.count(1)
        # records
        self.registers: list[RegisterRequest] = []
        self.register_headers: list[dict] = []
        self.heartbeats: list[Heartbeat] = []
        self.accepted: dict[str, dict] = {}         # aid → trajectory (wire)
        self.receipts: Counter[str] = Counter()     # aid → times a result reached us (not refused)
        self.results_calls = 0
        self.batch_sizes: list[tuple[int, int]] = []  # (results, bytes) of each /results call
        self.max_body: int | None = None             # /results bodies above this get 413
        self.refuse_tasks: set[str] = set()          # a /results body holding a scored result of these: 422
        self.returns: list[ReturnRequest] = []
        self.deregistered = 0
        self.register_conflict: str | None = None    # answer /register with 409 and this message
        self.cancelled: set[str] = set()
        # script
        self.to_cancel: set[str] = set()
        self.repins: dict[str, str] = {}
        self.drain = False
        self.say_unknown = True                     # heartbeat: attempts not leased → unknown
        self.results_script: list[Any] = []
        self.piggyback = False                      # answer `?lease=N` on beats and results (else ignore it)
        self.piggybacked = 0                        # leases that rode on those replies
        self.lease_calls = 0
        self.granting_lease_calls = 0  # those that handed out a lease (the others came back empty or done)
        # node-protocol features
        self.features: tuple[str, ...] = ()          # served to a daemon that asks (else ignored: an older controller)
        self.node_features: dict[str, set[str]] = {}  # node id → what it was told is served
        self.register_queries: list[str | None] = []  # each registration's ?features=
        self.beat_gap = 0.01                         # beatGap of replies to beat-results daemons
        self.fail_beat: Callable[[Heartbeat], int | None] | None = None  # a status: the beat refused unseen
        self.max_beat_body: int | None = None        # beats above this get 413
        self.beat_log: list[tuple[float, Heartbeat | None, frozenset[str], int]] = []  # (received, hb, leased, status)
        self.beat_fields: list[set[str]] = []        # the body fields of every beat
        self.results_on_beats: list[str] = []        # attempts whose result came on a beat (accepted or not)
        self.hold_next_lease = False
        self.lease_held = threading.Event()
        self.release_lease = threading.Event()
        self._server: ThreadServer | None = None
        self.app = self._make_app()

    # ------------------------------------------------------------------ work and waiting
    def add(self, *tasks: dict, samples: int = 1) -> None:
        with self.cond:
            base = len(self.attempts) + len(self.queue)
            for i, task in enumerate(tasks):
                for s in range(samples):
                    item = base + i * samples + s
                    self.queue.append({"item": item, "prompt": base + i, "sample": s, "task": task,
                                       "queued_at": time.monotonic()})
            self.cond.notify_all()

    def wait_for(self, predicate: Callable[[], Any], timeout: float, what: str = "condition") -> Any:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                value = predicate()
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
                self.cond.wait(min(left, 0.05))

    def cancel(self, aid: str) -> None:
        with self.cond:
            self.to_cancel.add(aid)

    def forget(self, aid: str) -> None:
        """Drop a lease as if it had expired here: the next heartbeat calls it unknown."""
        with self.cond:
            self.leased.pop(aid, None)

    def lease_of(self, task_id: str) -> Lease:
        return next(lease for lease in self.lease_log if lease.task.get("id") == task_id)

    def stages(self) -> dict[str, str]:
        """The stages of the most recent heartbeat."""
        with self.cond:
            return dict(self.heartbeats[-1].stages) if self.heartbeats else {}

    def done(self) -> bool:
        return not self.queue and not self.leased

    # ------------------------------------------------------------------ server
    def start(self) -> "FakeController":
        self._server = ThreadServer(self.app, self.port, "fake controller").start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self.release_lease.set()
            self._server.stop()
            self._server = None

    # ------------------------------------------------------------------ the six endpoints
    def _make_app(self) -> FastAPI:
        app = FastAPI()

        def authorized(request: Request) -> bool:
            return request.headers.get("authorization") == f"Bearer {self.token}"

        def ok(model) -> JSONResponse:  # as the controller: `lease`, the features' fields only for a caller that asked
            unasked = {f for f in ("lease", "features", "accepted", "dropped", "beat_gap")
                       if f in type(model).model_fields and getattr(model, f) is None}
            return JSONResponse(model.wire(exclude=unasked or None))

        def riding(request: Request):
            """`?lease=N` answered (with `piggyback` on; else ignored, as an older controller does)."""
            asked = request.query_params.get("lease")
            if not self.piggyback or asked is None:
                return None
            with self.cond:
                leases = [self._lease(item) for item in self.queue[: int(asked)]]
                del self.queue[: len(leases)]
                self.piggybacked += len(leases)
                self.cond.notify_all()
                return LeaseResponse(leases=leases, done=not leases and self.done())

        unauthorized = JSONResponse({"message": "bad token"}, status_code=401)

        @app.post(f"{P}/register")
        async def register(request: Request):
            if not authorized(request):
                return unauthorized
            req = RegisterRequest.model_validate(await request.json())
            asked = request.query_params.get(FEATURES_PARAM)
            with self.cond:
                self.registers.append(req)
                self.register_headers.append(dict(request.headers))
                self.register_queries.append(asked)
                node_id = f"node-{len(self.registers)}"
                served = None
                if asked is not None and self.features:
                    served = [f for f in asked.split(",") if f in self.features]
                    self.node_features[node_id] = set(served)
                self.cond.notify_all()
            if self.register_conflict:
                return JSONResponse({"message": self.register_conflict}, status_code=409)
            if req.job != self.job:
                return JSONResponse({"message": f"no job {req.job}"}, status_code=404)
            return ok(RegisterResponse(node_id=node_id, job=self.job, spec=self.spec, generation=1,
                                       lease_seconds=self.lease_seconds, heartbeat_seconds=self.heartbeat_seconds,
                                       features=served))

        @app.post(f"{P}/{{node_id}}/lease")
        async def lease(node_id: str, request: Request):
            if not authorized(request):
                return unauthorized
            req = LeaseRequest.model_validate(await request.json())
            self.lease_calls += 1
            if self.hold_next_lease:
                self.hold_next_lease = False
                with self.cond:
                    self.lease_held.set()
                    self.cond.notify_all()
                await asyncio.to_thread(self.release_lease.wait, 30)
            deadline = time.monotonic() + req.wait
            while True:
                with self.cond:
                    leases = [self._lease(item) for item in self.queue[: req.max_items]]
                    del self.queue[: len(leases)]
                    done = not leases and self.done()
                    self.cond.notify_all()
                if leases or done or time.monotonic() >= deadline or req.max_items == 0:
                    self.granting_lease_calls += bool(leases)
                    return ok(LeaseResponse(leases=leases, done=done))
                await asyncio.sleep(0.01)

        @app.post(f"{P}/{{node_id}}/heartbeat")
        async def heartbeat(node_id: str, request: Request):
            if not authorized(request):
                return unauthorized
            received = time.monotonic()
            raw = await request.body()
            body = json.loads(raw)
            served = self.node_features.get(node_id, set())
            unknown = {f for f, feature in (("results", BEAT_RESULTS), ("full", BEAT_DELTAS), ("llmTokens", TOKEN_SHARE),
                                            ("llmProcessed", WORK_SHARE), ("llmRateHeld", WORK_SHARE))
                       if feature not in served and f in body}
            too_large = self.max_beat_body is not None and len(raw) > self.max_beat_body
            with self.cond:
                self.beat_fields.append(set(body))
                leased = frozenset(self.leased)
                if unknown or too_large:
                    self.beat_log.append((received, None, leased, 422 if unknown else 413))
            if unknown:  # as a controller whose models do not know the field
                return JSONResponse({"detail": f"extra fields not permitted: {sorted(unknown)}"}, status_code=422)
            if too_large:
                return JSONResponse({"message": "request body too large"}, status_code=413)
            hb = Heartbeat.model_validate(body)
            refused = self.fail_beat(hb) if self.fail_beat is not None else None
            with self.cond:
                self.beat_log.append((received, hb, leased, refused or 200))
                self.cond.notify_all()
            if refused:
                return JSONResponse({"message": "scripted failure"}, status_code=refused)
            resp = HeartbeatResponse(lease_seconds=self.lease_seconds, drain=self.drain)
            with self.cond:
                self.heartbeats.append(hb)
                for aid in hb.stages:
                    if aid in self.to_cancel:
                        self.to_cancel.discard(aid)
                        self.cancelled.add(aid)
                        self.leased.pop(aid, None)
                        resp.cancel.append(aid)
                    elif aid in self.cancelled:
                        resp.cancel.append(aid)
                    elif aid not in self.leased:
                        if self.say_unknown:
                            resp.unknown.append(aid)
                    elif aid in self.repins:
                        resp.repin[aid] = self.repins.pop(aid)
                if BEAT_RESULTS in served:
                    self.results_on_beats += [res.attempt_id for res in hb.results]
                    ack = self._take(hb.results)
                    resp.accepted, resp.dropped, resp.beat_gap = ack.accepted, ack.dropped, self.beat_gap
                self.cond.notify_all()
            resp.lease = riding(request)
            return ok(resp)

        @app.post(f"{P}/{{node_id}}/results")
        async def results(node_id: str, request: Request):
            if not authorized(request):
                return unauthorized
            raw = await request.body()
            if self.max_body is not None and len(raw) > self.max_body:
                with self.cond:
                    self.results_calls += 1
                    # counted from the body (a trajectory names its attempt too: `attemptId` twice per result)
                    self.batch_sizes.append((len(json.loads(raw).get("results") or []), len(raw)))
                return JSONResponse({"message": "request body too large"}, status_code=413)
            body = json.loads(raw)
            with self.cond:
                self.results_calls += 1
                self.batch_sizes.append((len(body["results"]), len(raw)))
                action = self.results_script.pop(0) if self.results_script else None
                self.cond.notify_all()
            if action == 503:
                return JSONResponse({"message": "controller restarting"}, status_code=503)
            batch = ResultBatch.model_validate(body)
            bad = [i for i, r in enumerate(batch.results)
                   if r.trajectory.task_id in self.refuse_tasks and r.trajectory.reward is not None]
            if bad:  # as the real controller refuses a result it cannot take: the whole call, naming the first
                return JSONResponse({"message": f"results[{bad[0]}] is invalid"}, status_code=422)
            with self.cond:
                ack = self._take(batch.results)
                self.cond.notify_all()
            if action == "lose":
                return JSONResponse({"message": "reply lost"}, status_code=503)
            ack.lease = riding(request)
            return ok(ack)

        @app.post(f"{P}/{{node_id}}/return")
        async def give_back(node_id: str, request: Request):
            if not authorized(request):
                return unauthorized
            req = ReturnRequest.model_validate(await request.json())
            with self.cond:
                self.returns.append(req)
                for aid in req.attempt_ids:
                    item = self.leased.pop(aid, None)
                    if item is not None:
                        self.queue.append(item)
                self.cond.notify_all()
            return {"returned": len(req.attempt_ids)}

        @app.post(f"{P}/{{node_id}}/deregister")
        async def deregister(node_id: str, request: Request):
            if not authorized(request):
                return unauthorized
            with self.cond:
                self.deregistered += 1
                self.cond.notify_all()
            return {}

        return app

    def _take(self, results: list[Result]) -> ResultAck:
        """Results applied as the scheduler applies them (under `cond`), from /results or a beat."""
        ack = ResultAck()
        for res in results:
            self.receipts[res.attempt_id] += 1
            if res.attempt_id in self.leased:
                del self.leased[res.attempt_id]
                self.accepted[res.attempt_id] = res.trajectory.wire()
                ack.accepted.append(res.attempt_id)
            elif res.attempt_id in self.cancelled:
                ack.dropped[res.attempt_id] = "cancelled"
            else:
                ack.dropped[res.attempt_id] = "stale attempt"
        return ack

    def _lease(self, item: dict) -> Lease:
        self.attempts[item["item"]] += 1
        attempt = self.attempts[item["item"]]
        aid = f"{item['item']}.{attempt}.{next(self._ids):04d}"
        lease = Lease(attempt_id=aid, item=item["item"], prompt=item["prompt"], sample=item["sample"],
                      attempt=attempt, task=item["task"], backend=self.backend,
                      policy_version=self.policy_version,
                      queued_seconds=round(0.25 + 0.01 * item["item"], 4))
        self.leased[aid] = item
        self.lease_log.append(lease)
        return lease
