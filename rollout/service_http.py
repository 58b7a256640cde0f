"""HTTP API of the rollout service: ``/process``, ``/cancel``, ``/status`` (ProRL Agent style).

Every endpoint but ``/health`` needs ``Authorization: Bearer <token>``. Serve it on
127.0.0.1 or on a Unix domain socket with :class:`ServiceServer`. Errors are JSON
``{"detail": message}``: 400 a body that does not parse or validate (one line saying why, as
the gateway answers one), 401 bad token, 404 no such rollout in flight to cancel, 409 a
rollout id already in flight or a rollout cancelled. A rollout whose client disconnects is
cancelled; a request that reuses its id waits for it to end rather than being refused (a
``/cancel`` of the id reaches it meanwhile).
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from envs import registry
from envs.base import Id, Task
from rollout.http_server import AppServer, bad_body, bearer_matches, bearer_token
from rollout.service import DuplicateRollout, RolloutRequest, RolloutResult, RolloutService


def _registered(name: str) -> str:
    if name not in registry.REGISTRY:
        raise ValueError(f"unknown environment {name!r}; known: {sorted(registry.REGISTRY)}")
    return name


class ProcessTask(Task):
    """A task whose env is registered in this process: naming another is the caller's
    mistake (a 400), not an env error of the service."""

    env: Annotated[Id, AfterValidator(_registered)] = Field(
        description="Name of the environment the task belongs to (a registered one)."
    )


class ProcessRequest(BaseModel):
    """One rollout to run; ids left out are generated."""

    model_config = ConfigDict(extra="forbid")

    task: ProcessTask = Field(description="The task instance (env name, id, prompt, private data).")
    rollout_id: Id | None = Field(
        None,
        description="Id to cancel it by; generated when left out. An id in flight is refused (409), unless "
        "its client has disconnected: then this request waits for that rollout to end.",
    )
    execution_id: Id | None = Field(
        None,
        description="Execution the trajectory belongs to; the trajectory's own id when left out.",
    )
    group_id: Id | None = Field(
        None,
        description="Group (GRPO mode: the trainer pools the advantages of rollouts sharing it).",
    )
    seed: int | None = Field(
        None,
        ge=-(2**63),
        lt=2**63,
        description="Sampling seed of the rollout, a signed 64-bit integer (turn t samples with a hash of "
        "it and t: rollout.service.turn_seed).",
    )
    include_tokens: bool = Field(
        True,
        description="Return the whole trajectory record (and, under ServiceConfig.compact_at, the records of "
        "the contexts it left, in 'branches'), not just the summary.",
    )


class CancelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rollout_id: str = Field(description="Rollout to cancel.")


def create_app(service: RolloutService, token: str) -> FastAPI:
    """The FastAPI app serving ``service``; requests must carry ``Bearer token``."""
    if not token:
        raise ValueError("the rollout service needs a non-empty bearer token")
    expected = token.encode()

    def authorize(authorization: str | None = Header(None)) -> None:
        if not bearer_matches(authorization, expected):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    # no OpenAPI schema nor docs pages: they would answer without the token
    app = FastAPI(title="treadle rollout service", openapi_url=None)
    dropped: dict[str, asyncio.Task] = {}
    """Rollouts cancelled because their client went away, by id, until they have unwound."""
    retries: dict[str, set[asyncio.Task]] = {}
    """Retries of a dropped rollout waiting for it to unwind, by id: not yet in the service's
    flight, where a cancel would find them."""

    async def after_dropped(request: RolloutRequest) -> RolloutResult:
        # a client that dropped its request and retries it must not be refused as a duplicate
        # of the rollout it gave up, still closing its env
        if (prior := dropped.get(request.rollout_id)) is not None:
            waiting = retries.setdefault(request.rollout_id, set())
            waiting.add(asyncio.current_task())
            try:
                await asyncio.wait([prior])
            finally:
                waiting.discard(asyncio.current_task())
                if not waiting:
                    retries.pop(request.rollout_id, None)
        return await service.process(request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        # not FastAPI's 422, which leaves out the parser's reason and echoes each bad input
        # (a 500 for one holding a lone surrogate); ASCII JSON escapes any in a location
        return Response(json.dumps({"detail": bad_body(exc)}), 400, media_type="application/json")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"ok": True}

    @app.post("/process", dependencies=[Depends(authorize)])
    async def process(body: ProcessRequest, http: Request) -> dict[str, Any]:
        request = RolloutRequest(
            task=body.task, execution_id=body.execution_id, group_id=body.group_id, seed=body.seed
        )
        if body.rollout_id:
            request.rollout_id = body.rollout_id
        rollout = asyncio.create_task(after_dropped(request))
        # the server never cancels a handler whose client went away: its rollout would hold a
        # slot and its env until it ended, for no one (and a retry of it be refused meanwhile)
        watch = asyncio.create_task(_cancel_when_gone(http, rollout, request.rollout_id, dropped))
        try:
            result = await rollout
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # this handler is cancelled, not the rollout alone
                raise
            raise HTTPException(409, f"rollout {request.rollout_id} was cancelled") from None
        except DuplicateRollout as exc:
            raise HTTPException(409, str(exc)) from None
        finally:
            watch.cancel()
        response = result.summary()
        if body.include_tokens:
            response["record"] = result.record
            response["branches"] = result.branches
        return response

    @app.post("/cancel", dependencies=[Depends(authorize)])
    async def cancel(body: CancelRequest) -> dict[str, Any]:
        waiting = list(retries.get(body.rollout_id, ()))
        for retry in waiting:
            retry.cancel()
        if not service.cancel(body.rollout_id) and not waiting:
            raise HTTPException(404, f"no rollout {body.rollout_id!r} in flight")
        return {"cancelled": body.rollout_id}

    @app.get("/status", dependencies=[Depends(authorize)])
    async def status() -> dict[str, Any]:
        return service.status()

    return app


async def _cancel_when_gone(
    http: Request, rollout: asyncio.Task, rollout_id: str, dropped: dict[str, asyncio.Task]
) -> None:
    """Cancel ``rollout`` once the client of ``http`` (its body read) has disconnected, and
    hold it in ``dropped`` under ``rollout_id`` until it has ended (unless a rollout dropped
    before under that id, which it waited for, is still there)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
    rollout.cancel()
    if (prior := dropped.get(rollout_id)) is not None and not prior.done():
        return  # a retry dropped while it waited for ``prior``, which still holds the id
    dropped[rollout_id] = rollout

    def forget(_: asyncio.Task) -> None:
        if dropped.get(rollout_id) is rollout:  # not a later retry of it, dropped in turn
            del dropped[rollout_id]

    rollout.add_done_callback(forget)


class ServiceServer(AppServer):
    """Serves a rollout service on 127.0.0.1 (``port=0``: a free port) or a Unix socket."""

    def __init__(self, service: RolloutService, *, token: str | None = None, **bind: Any):
        self.token = bearer_token(token)
        super().__init__(create_app(service, self.token), name="rollout-service", token=self.token, **bind)
