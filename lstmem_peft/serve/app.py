"""The FastAPI application: OpenAI-compatible routes, memory routes, health, metrics and the page.

Sessions are chosen by the ``X-Session-Id`` header (chat and completions) or the path (memory
routes). With API keys, each key sees only its own sessions (:func:`~.store.namespace_for`).
Errors are OpenAI-style JSON ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx code.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import asdict

from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..cache import MemoryCache
from .page import PAGE
from .runtime import LoadedModel, Sampling, state_norms
from .scheduler import Job, Scheduler, ServeError
from .schemas import ChatCompletionRequest, CompletionRequest, MemoryWriteRequest
from .store import SessionIdError, SessionStore, check_session_id, namespace_for

SESSION_HEADER = "X-Session-Id"


class Metrics:
    """Prometheus metrics of one app (its own registry, so several apps can live in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "lstmem_requests", "HTTP requests", ["route", "status"], registry=self.registry
        )
        self.tokens = Counter(
            "lstmem_tokens",
            "tokens: prompt (in context), completion, memory (written)",
            ["kind"],
            registry=self.registry,
        )
        self.sessions = Gauge("lstmem_sessions", "sessions in the store's memory", registry=self.registry)
        self.queued = Gauge("lstmem_queued_jobs", "jobs waiting for the worker", registry=self.registry)
        self.batch_size = Histogram(
            "lstmem_batch_size",
            "jobs per batch",
            ["kind"],
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=self.registry,
        )
        self.latency = Histogram(
            "lstmem_request_seconds",
            "request latency",
            ["route"],
            registry=self.registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )


def error_json(status: int, message: str, type: str = "invalid_request_error", code=None, param=None):
    return JSONResponse(
        {"error": {"message": message, "type": type, "param": param, "code": code}}, status_code=status
    )


class BodyLimit:
    """ASGI middleware: refuse request bodies over ``limit`` bytes with 413 (declared or streamed)."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        too_big = error_json(
            413,
            f"request body over {self.limit} bytes; write long text into memory in parts",
            code="body_too_large",
        )
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await too_big(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge()
            return message

        try:
            return await self.app(scope, limited, send)
        except _TooLarge:
            return await too_big(scope, receive, send)


class _TooLarge(Exception):
    pass


def create_app(
    loaded: LoadedModel,
    store_dir: str,
    context_window: int | None = None,
    api_keys: list[str] | None = None,
    max_batch: int = 32,
    batch_wait_ms: float = 5.0,
    batching: bool = True,
    max_body_bytes: int = 1 << 20,
    default_max_tokens: int = 64,
) -> FastAPI:
    """Build the app around a loaded model.

    Args:
        loaded: :class:`~.runtime.LoadedModel`.
        store_dir: where sessions live (created if missing).
        context_window: tokens of the prompt window (default: the backbone's position limit, at most 4096).
        api_keys: accepted bearer keys; ``None`` or empty: no authentication, one shared namespace.
        max_batch: most sessions per batched forward.
        batch_wait_ms: how long the worker waits for more requests to batch with the first one.
        batching: ``False`` runs requests one at a time (the benchmark's baseline).
        max_body_bytes: larger request bodies get 413.
        default_max_tokens: ``max_tokens`` of chat requests that give none.
    """
    limit = loaded.max_positions
    window = context_window or min(limit or 4096, 4096)
    if limit is not None and window > limit:
        raise ValueError(f"--context-window {window} is over the model's position limit {limit}")
    metrics = Metrics()
    store = SessionStore(store_dir, loaded.layout)
    scheduler = Scheduler(
        loaded,
        store,
        window,
        max_batch=max_batch,
        batch_wait=batch_wait_ms / 1000,
        batching=batching,
        metrics=metrics,
    )
    keys = set(api_keys or [])
    adapter_fingerprint = _adapter_fingerprint(loaded)

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(
        title="lstmem serve",
        version=__version__,
        description="OpenAI-compatible server whose sessions keep a persistent LSTMem memory.",
        lifespan=lifespan,
    )
    app.state.scheduler, app.state.store, app.state.loaded, app.state.metrics = (
        scheduler,
        store,
        loaded,
        metrics,
    )
    app.add_middleware(BodyLimit, limit=max_body_bytes)

    # ------------------------------------------------------------------ errors
    @app.exception_handler(ServeError)
    async def _serve_error(request, err: ServeError):
        return error_json(err.status, err.message, err.type, err.code, err.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        kind = first.get("type", "")
        if kind == "json_invalid":
            return error_json(400, f"the body is not valid JSON: {first.get('msg')}", code="invalid_json")
        return error_json(
            400,
            f"{where or 'body'}: {first.get('msg', 'invalid')}",
            param=where or None,
            code="invalid_value",
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, err: StarletteHTTPException):
        return error_json(
            err.status_code, str(err.detail), code="not_found" if err.status_code == 404 else None
        )

    @app.middleware("http")
    async def _count(request: Request, call_next):
        start = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        name = getattr(route, "path", "unmatched")
        metrics.requests.labels(route=name, status=str(response.status_code)).inc()
        metrics.latency.labels(route=name).observe(time.perf_counter() - start)
        return response

    # ------------------------------------------------------------------ dependencies
    def namespace(authorization: str | None = Header(None)) -> str:
        if not keys:
            return namespace_for(None)
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or key not in keys:
            raise ServeError(
                401, "missing or unknown API key (Authorization: Bearer KEY)", code="invalid_api_key"
            )
        return namespace_for(key)

    def session_header(x_session_id: str | None = Header(None)) -> str | None:
        if x_session_id is None:
            return None
        return _valid_session(x_session_id)

    def check_model(name: str) -> None:
        if name != loaded.name:
            raise ServeError(
                404,
                f"the model {name!r} does not exist; this server serves {loaded.name!r}",
                code="model_not_found",
                param="model",
            )

    def check_max_tokens(max_tokens: int) -> None:
        if max_tokens >= window:
            raise ServeError(
                400,
                f"max_tokens {max_tokens} does not fit the context window of {window} tokens",
                code="context_length_exceeded",
                param="max_tokens",
            )

    async def run(job: Job) -> dict:
        scheduler.submit(job)
        metrics.queued.set(scheduler.queued)
        kind, *rest = await job.events.get()
        while kind == "delta":
            kind, *rest = await job.events.get()
        if kind == "error":
            raise rest[0]
        return rest[0]

    # ------------------------------------------------------------------ OpenAI routes
    @app.get("/v1/models")
    async def models(ns: str = Depends(namespace)):
        return {
            "object": "list",
            "data": [{"id": loaded.name, "object": "model", "created": 0, "owned_by": "lstmem"}],
        }

    @app.post("/v1/chat/completions")
    async def chat(
        body: ChatCompletionRequest, ns: str = Depends(namespace), sid: str | None = Depends(session_header)
    ):
        check_model(body.model)
        max_tokens = body.max_completion_tokens or body.max_tokens or default_max_tokens
        check_max_tokens(max_tokens)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        return await _turn(
            body,
            ns,
            sid,
            max_tokens,
            {"mode": "chat", "messages": messages, "display": messages[-1]["content"]},
        )

    @app.post("/v1/completions")
    async def completions(
        body: CompletionRequest, ns: str = Depends(namespace), sid: str | None = Depends(session_header)
    ):
        check_model(body.model)
        check_max_tokens(body.max_tokens)
        prompt = body.prompt_text()
        if not prompt:
            raise ServeError(400, "the prompt is empty", param="prompt")
        return await _turn(
            body, ns, sid, body.max_tokens, {"mode": "completion", "prompt": prompt, "display": prompt[-500:]}
        )

    async def _turn(body, ns, sid, max_tokens, payload):
        sampling = Sampling(max_tokens, body.temperature, body.top_p, body.n, body.stops(), body.seed)
        job = Job("turn", ns, sid, payload, sampling=sampling, stream=body.stream)
        chat = payload["mode"] == "chat"
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if not body.stream:
            result = await run(job)
            return _completion_body(result, ident, created, chat, sid)
        scheduler.submit(job)
        first = await job.events.get()
        if first[0] == "error":
            raise first[1]
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(
            _sse(job, first, ident, created, chat, sampling.n, include_usage, sid),
            media_type="text/event-stream",
        )

    def _chunk(ident, created, chat, choices, usage=None):
        out = {
            "id": ident,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": loaded.name,
            "choices": choices,
        }
        if usage is not None:
            out["usage"] = usage
        return "data: " + json.dumps(out) + "\n\n"

    async def _sse(job, first, ident, created, chat, n, include_usage, sid):
        event = first
        try:
            if chat:
                yield _chunk(
                    ident,
                    created,
                    chat,
                    [
                        {"index": c, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                        for c in range(n)
                    ],
                )
            while True:
                kind = event[0]
                if kind == "delta":
                    _, c, text = event
                    choice = {"index": c, "delta": {"content": text}} if chat else {"index": c, "text": text}
                    yield _chunk(ident, created, chat, [{**choice, "finish_reason": None}])
                elif kind == "error":
                    err = event[1]
                    yield (
                        "data: "
                        + json.dumps({"error": {"message": err.message, "type": err.type, "code": err.code}})
                        + "\n\n"
                    )
                    break
                else:
                    result = event[1]
                    for c, answer in enumerate(result["choices"]):
                        end = {"index": c, "finish_reason": answer.finish_reason}
                        end.update({"delta": {}} if chat else {"text": ""})
                        yield _chunk(ident, created, chat, [end])
                    _count_tokens(result)
                    if include_usage:
                        yield _chunk(ident, created, chat, [], _usage(result, sid))
                    break
                event = await job.events.get()
            yield "data: [DONE]\n\n"
        finally:
            if event[0] not in ("done", "error"):
                job.cancelled.set()  # the client went away: decoding of its rows stops, nothing is committed

    def _count_tokens(result):
        metrics.tokens.labels(kind="prompt").inc(result["prompt_tokens"])
        metrics.tokens.labels(kind="completion").inc(sum(len(a.token_ids) for a in result["choices"]))
        metrics.tokens.labels(kind="memory").inc(result["written"])

    def _usage(result, sid):
        completion = sum(len(a.token_ids) for a in result["choices"])
        return {
            "prompt_tokens": result["prompt_tokens"],
            "completion_tokens": completion,
            "total_tokens": result["prompt_tokens"] + completion,
        }

    def _completion_body(result, ident, created, chat, sid):
        _count_tokens(result)
        choices = []
        for c, answer in enumerate(result["choices"]):
            if chat:
                choices.append(
                    {
                        "index": c,
                        "message": {"role": "assistant", "content": answer.text},
                        "finish_reason": answer.finish_reason,
                        "logprobs": None,
                    }
                )
            else:
                choices.append(
                    {"index": c, "text": answer.text, "finish_reason": answer.finish_reason, "logprobs": None}
                )
        return {
            "id": ident,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": loaded.name,
            "choices": choices,
            "usage": _usage(result, sid),
            "lstmem": {
                "session": sid,
                "memory_tokens_written": result["written"],
                "session_tokens_written": result["tokens_written"],
                "batch_size": result["batch"],
            },
        }

    # ------------------------------------------------------------------ memory routes
    @app.post("/v1/memory/{session}/write")
    async def memory_write(session: str, body: MemoryWriteRequest, ns: str = Depends(namespace)):
        _valid_session(session)
        if body.messages is not None:
            payload = {
                "messages": [{"role": m.role, "content": m.text()} for m in body.messages],
                "display": body.messages[-1].text()[-500:],
            }
        else:
            payload = {"text": body.text, "display": body.text[-500:]}
        result = await run(Job("write", ns, session, payload))
        metrics.tokens.labels(kind="memory").inc(result["written"])
        return {
            "session": session,
            "tokens_written": result["written"],
            "session_tokens_written": result["tokens_written"],
        }

    @app.get("/v1/memory/{session}")
    async def memory_info(session: str, ns: str = Depends(namespace)):
        _valid_session(session)
        s = store.get(ns, session)
        layout = loaded.layout
        norms = state_norms(s.memory) if s.memory is not None else {"cell": [], "hidden": []}
        gates = next((t["gates"] for t in reversed(s.turns) if t.get("gates")), None)
        layers = []
        for i, index in enumerate(layout.layer_indices):
            layers.append(
                {
                    "layer_index": index,
                    "cell_norm": norms["cell"][i] if norms["cell"] else 0.0,
                    "hidden_norm": norms["hidden"][i] if norms["hidden"] else 0.0,
                    "out_gate_mean": gates["out_gate"][i] if gates else None,
                    "depth_gate_mean": gates["depth_gate"][i] if gates else None,
                }
            )
        return {
            "session": session,
            "exists": s.version > 0,
            "tokens_written": s.tokens_written,
            "commit": s.version,
            "messages_written": len(s.messages),
            "layout": {**asdict(layout), "layer_indices": list(layout.layer_indices)},
            "fingerprint": layout.fingerprint(),
            "adapter_fingerprint": adapter_fingerprint,
            "state_bytes": 0 if s.memory is None else s.memory.nbytes,
            "layers": layers,
            "turns": s.turns,
        }

    @app.delete("/v1/memory/{session}")
    async def memory_reset(session: str, ns: str = Depends(namespace)):
        _valid_session(session)
        result = await run(Job("reset", ns, session, {}))
        return {"session": session, "deleted": result["deleted"]}

    @app.get("/v1/memory/{session}/export")
    async def memory_export(session: str, ns: str = Depends(namespace)):
        _valid_session(session)
        for _ in range(3):  # a commit may replace the file between the lookup and the read
            path = store.memory_path(ns, session)
            if path is None:
                raise ServeError(
                    404, f"session {session!r} has no memory yet (nothing written)", code="not_found"
                )
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                continue
            return Response(
                data,
                media_type="application/octet-stream",
                headers={"Content-Disposition": f'attachment; filename="{session}.safetensors"'},
            )
        raise ServeError(503, "the session kept changing during the export; retry", type="server_error")

    @app.put("/v1/memory/{session}/import")
    async def memory_import(session: str, request: Request, ns: str = Depends(namespace)):
        _valid_session(session)
        data = await request.body()
        if not data:
            raise ServeError(400, "the body is empty: send the bytes of a MemoryCache file (an export)")
        fd, tmp = tempfile.mkstemp(suffix=".safetensors")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            try:
                memory = MemoryCache.load(tmp, layout=loaded.layout)
            except ValueError as err:
                message = str(err).replace(tmp, "the uploaded file")
                raise ServeError(
                    409 if "was saved for" in message else 400, message, code="incompatible_memory"
                ) from None
        finally:
            os.unlink(tmp)
        if memory.batch_size != 1:
            raise ServeError(
                400, f"the file holds {memory.batch_size} sessions; import one session's memory (one row)"
            )
        result = await run(Job("import", ns, session, {"memory": memory}))
        return {"session": session, "tokens_written": result["tokens_written"]}

    @app.get("/v1/sessions")
    async def sessions(ns: str = Depends(namespace)):
        return {"object": "list", "data": store.list(ns)}

    # ------------------------------------------------------------------ operations
    @app.get("/health")
    async def health():
        return {"status": "ok", "model": loaded.name, "queued": scheduler.queued}

    @app.get("/metrics")
    async def prometheus():
        metrics.sessions.set(len(store._sessions))
        metrics.queued.set(scheduler.queued)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return PAGE

    return app


def _valid_session(session: str) -> str:
    try:
        return check_session_id(session)
    except SessionIdError as err:
        raise ServeError(400, str(err), code="invalid_session_id", param="session") from None


def _adapter_fingerprint(loaded: LoadedModel) -> str:
    """SHA-256 (16 hex) of the memory layers' parameters: changes whenever the adapter's weights do."""
    from ..history import memory_layers

    digest = hashlib.sha256()
    for layer in memory_layers(loaded.model):
        for name, p in sorted(layer.state_dict().items()):
            digest.update(name.encode())
            digest.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]
