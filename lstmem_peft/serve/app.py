"""The FastAPI application: OpenAI-compatible routes, memory routes, health, metrics and the page.

Sessions are chosen by the ``X-Session-Id`` header (chat and completions) or the path (memory
routes). With API keys, each key sees only its own sessions (:func:`~.store.namespace_for`).
Errors are OpenAI-style JSON ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx code.

OpenAI compatibility: ``/v1/completions`` takes a prompt, a list of prompts or token-id prompts,
``echo``, and ``logprobs`` (with ``max_tokens=0`` and ``echo``: scoring only, which reads memory and
writes nothing); ``/v1/chat/completions`` takes ``logprobs`` / ``top_logprobs``. A parameter this
server does not implement is refused with a 400 error naming it (see :mod:`.schemas`).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import math
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

from lstmem_peft.memory.cache import MemoryCache
from lstmem_peft.utils.version import __version__

from .page import PAGE
from .runtime import Answer, LoadedModel, Sampling, TokenLogprobs, state_norms
from .scheduler import Job, Scheduler, ServeError
from .schemas import MAX_PROMPTS, ChatCompletionRequest, CompletionRequest, MemoryWriteRequest
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


class JsonBody:
    """ASGI middleware: the body of a ``POST /v1/...`` sent without a Content-Type, or as
    ``application/x-www-form-urlencoded`` (what ``curl -d`` sends) or ``text/plain``, is read as
    JSON (every such route takes JSON); a body that is not JSON then gets the invalid-JSON error."""

    LOOSE = (b"", b"application/x-www-form-urlencoded", b"text/plain")

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"].startswith("/v1/"):
            headers = list(scope.get("headers") or [])
            kind = next((v for k, v in headers if k == b"content-type"), b"")
            if kind.split(b";")[0].strip().lower() in self.LOOSE:
                headers = [(k, v) for k, v in headers if k != b"content-type"]
                scope = {**scope, "headers": headers + [(b"content-type", b"application/json")]}
        return await self.app(scope, receive, send)


#: Parts of a pydantic error location that name a union member, not a field.
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _where(loc) -> str:
    parts = [
        str(x)
        for x in loc
        if x != "body"
        and (
            isinstance(x, int)
            or ("[" not in str(x) and str(x) not in _TYPE_TAGS and not str(x).startswith("function-"))
        )
    ]
    return ".".join(parts)


def _finite(x: float | None) -> float | None:
    """JSON has no infinity: a log-probability of -inf (a token the model rules out) is -9999."""
    return x if x is None or math.isfinite(x) else -9999.0


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
    app.add_middleware(JsonBody)
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    try:  # the request handlers' own tokenizer (the worker thread uses loaded.tokenizer)
        tokenizer = copy.deepcopy(loaded.tokenizer)
    except Exception:  # noqa: BLE001  (a tokenizer that cannot be copied is shared)
        tokenizer = loaded.tokenizer
    try:
        vocab = int(loaded.model.get_input_embeddings().num_embeddings)
    except Exception:  # noqa: BLE001
        vocab = len(loaded.tokenizer)

    # ------------------------------------------------------------------ errors
    @app.exception_handler(ServeError)
    async def _serve_error(request, err: ServeError):
        return error_json(err.status, err.message, err.type, err.code, err.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        where = _where(first.get("loc", ()))
        param = where.split(".")[0] or None
        kind = first.get("type", "")
        message = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        if kind == "json_invalid":
            return error_json(
                400,
                f"the body is not valid JSON ({message}); send a JSON object with Content-Type: application/json",
                code="invalid_json",
            )
        if not where:
            return error_json(
                400,
                f"the body must be a JSON object with the request's parameters, sent with Content-Type: "
                f"application/json ({message})",
                code="invalid_body",
            )
        if kind == "extra_forbidden":
            return error_json(
                400,
                f"unsupported parameter {where!r}: this server does not implement it",
                param=param,
                code="unsupported_parameter",
            )
        unsupported = "not supported by this server" in message
        return error_json(
            400,
            f"{where}: {message}",
            param=param,
            code="unsupported_parameter" if unsupported else "invalid_value",
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
            "data": [model_card()],
        }

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, ns: str = Depends(namespace)):
        check_model(model_id)
        return model_card()

    def model_card() -> dict:
        return {"id": loaded.name, "object": "model", "created": 0, "owned_by": "lstmem"}

    @app.post("/v1/chat/completions")
    async def chat(
        body: ChatCompletionRequest, ns: str = Depends(namespace), sid: str | None = Depends(session_header)
    ):
        check_model(body.model)
        check_stream_options(body)
        max_tokens = body.max_completion_tokens or body.max_tokens or default_max_tokens
        check_max_tokens(max_tokens)
        if body.top_logprobs is not None and not body.logprobs:
            raise ServeError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if body.logprobs and body.stream:
            raise ServeError(
                400,
                "logprobs is not available with stream=true",
                param="logprobs",
                code="unsupported_parameter",
            )
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        job = Job(
            "turn",
            ns,
            sid,
            {"mode": "chat", "messages": messages, "display": messages[-1]["content"]},
            sampling=sampling_of(body, max_tokens, logprobs),
            stream=body.stream,
        )
        return await _respond(body, [job], None, True, sid)

    @app.post("/v1/completions")
    async def completions(
        body: CompletionRequest, ns: str = Depends(namespace), sid: str | None = Depends(session_header)
    ):
        check_model(body.model)
        check_stream_options(body)
        prompts = body.prompts()
        n = body.n
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        if body.best_of is not None and body.best_of != n:
            raise ServeError(
                400,
                f"best_of {body.best_of} with n {n} is not supported: best_of must equal n (every sequence "
                "decoded is returned; none is picked by log-probability)",
                param="best_of",
                code="unsupported_parameter",
            )
        if max_tokens == 0 and not body.echo:
            raise ServeError(
                400,
                "max_tokens 0 only scores a prompt: pass echo=true (and logprobs for its tokens' log-probabilities)",
                param="max_tokens",
            )
        check_max_tokens(max_tokens)
        if len(prompts) > 1 and sid is not None:
            raise ServeError(
                400,
                f"a request on a session ({SESSION_HEADER}) takes one prompt; send a list of prompts without a session",
                param="prompt",
            )
        if len(prompts) * n > MAX_PROMPTS:
            raise ServeError(
                400,
                f"prompts x n is {len(prompts) * n}; at most {MAX_PROMPTS} choices per request",
                param="n",
            )
        if body.stream and len(prompts) > 1:
            raise ServeError(
                400, "stream=true takes one prompt per request", param="stream", code="unsupported_parameter"
            )
        if body.stream and body.logprobs is not None:
            raise ServeError(
                400,
                "logprobs is not available with stream=true",
                param="logprobs",
                code="unsupported_parameter",
            )
        for i, p in enumerate(prompts):
            if not isinstance(p, str) and max(p) >= vocab:
                raise ServeError(
                    400,
                    f"prompt {i} has token id {max(p)}; the vocabulary has {vocab} tokens",
                    param="prompt",
                )
        texts = [p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
        if body.echo and max_tokens > 0:  # the echoed tokens must be the whole prompt, in context
            for i, p in enumerate(prompts):
                count = (
                    len(p)
                    if not isinstance(p, str)
                    else len(tokenizer(p, add_special_tokens=False)["input_ids"])
                )
                if count + max_tokens > window:
                    raise ServeError(
                        400,
                        f"prompt {i} is {count} tokens; with echo the whole prompt and max_tokens {max_tokens} "
                        f"must fit the context window of {window} tokens",
                        code="context_length_exceeded",
                        param="prompt",
                    )
        sampling = sampling_of(body, max_tokens, body.logprobs, echo=body.echo)
        jobs = [
            Job(
                "score" if max_tokens == 0 else "turn",
                ns,
                sid,
                {"mode": "completion", "prompt": p, "display": text[-500:]},
                sampling=sampling,
                stream=body.stream,
            )
            for p, text in zip(prompts, texts, strict=True)
        ]
        return await _respond(body, jobs, texts, False, sid)

    def check_stream_options(body) -> None:
        if body.stream_options is not None and not body.stream:
            raise ServeError(400, "stream_options needs stream=true", param="stream_options")

    def sampling_of(body, max_tokens: int, logprobs: int | None, echo: bool = False) -> Sampling:
        """The decoding parameters. Greedy (``temperature`` 0, or ``top_p`` 0: a nucleus of the one
        most likely token) decoding has no seed to apply, so seeded greedy requests batch."""
        if body.greedy:
            return Sampling(max_tokens, 0.0, 1.0, body.n, body.stops(), None, logprobs, echo)
        return Sampling(
            max_tokens, body.temperature, body.top_p, body.n, body.stops(), body.seed, logprobs, echo
        )

    async def _respond(body, jobs: list[Job], texts: list[str] | None, chat: bool, sid):
        """Run the jobs (one per prompt) and answer: one JSON body, or a stream (one job)."""
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        echoes = texts if (texts is not None and body.echo) else None
        if not body.stream:
            results = await asyncio.gather(*(run(job) for job in jobs))
            return _completion_body(results, ident, created, chat, sid, body.n, texts, echoes)
        job = jobs[0]
        scheduler.submit(job)
        first = await job.events.get()
        if first[0] == "error":
            raise first[1]
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _sse(job, first, ident, created, chat, body.n, include_usage, sid, echoes[0] if echoes else ""),
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

    async def _sse(job, first, ident, created, chat, n, include_usage, sid, echo=""):
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
            elif echo:
                yield _chunk(
                    ident,
                    created,
                    chat,
                    [{"index": c, "text": echo, "finish_reason": None} for c in range(n)],
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
                        yield _chunk(ident, created, chat, [], _usage([result]))
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

    def _usage(results):
        prompt = sum(r["prompt_tokens"] for r in results)
        completion = sum(len(a.token_ids) for r in results for a in r["choices"])
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _chat_logprobs(answer: Answer) -> dict:
        """OpenAI's chat form: one entry per answer token (the EOS that ended it is not one)."""
        lp: TokenLogprobs = answer.logprobs
        content = []
        for t in range(len(answer.token_ids)):
            content.append(
                {
                    "token": lp.tokens[t],
                    "logprob": _finite(lp.logprobs[t]),
                    "bytes": list(lp.tokens[t].encode()),
                    "top_logprobs": [
                        {"token": x, "logprob": _finite(v), "bytes": list(x.encode())} for x, v in lp.top[t]
                    ],
                }
            )
        return {"content": content, "refusal": None}

    def _completion_logprobs(lp: TokenLogprobs, offset: int) -> dict:
        """OpenAI's completions form: ``tokens``, ``token_logprobs``, ``top_logprobs`` (a dict per
        token, ``None`` for a prompt's first token) and ``text_offset`` (characters into the text)."""
        offsets = []
        for token in lp.tokens:
            offsets.append(offset)
            offset += len(token)
        tops = []
        for top in lp.top:
            if top is None:
                tops.append(None)
                continue
            best: dict[str, float] = {}
            for x, v in top:  # best first: a text two tokens share keeps its better value
                best.setdefault(x, _finite(v))
            tops.append(best)
        return {
            "tokens": lp.tokens,
            "token_logprobs": [_finite(x) for x in lp.logprobs],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _completion_body(results, ident, created, chat, sid, n, texts=None, echoes=None):
        choices = []
        for p, result in enumerate(results):
            _count_tokens(result)
            for c, answer in enumerate(result["choices"]):
                index = p * n + c
                if chat:
                    choices.append(
                        {
                            "index": index,
                            "message": {"role": "assistant", "content": answer.text},
                            "finish_reason": answer.finish_reason,
                            "logprobs": None if answer.logprobs is None else _chat_logprobs(answer),
                        }
                    )
                    continue
                echo = echoes[p] if echoes else ""
                logprobs = None
                if answer.logprobs is not None:
                    logprobs = _completion_logprobs(answer.logprobs, 0 if echoes else len(texts[p]))
                choices.append(
                    {
                        "index": index,
                        "text": echo + answer.text,
                        "finish_reason": answer.finish_reason,
                        "logprobs": logprobs,
                    }
                )
        return {
            "id": ident,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": loaded.name,
            "choices": choices,
            "usage": _usage(results),
            "lstmem": {
                "session": sid,
                "memory_tokens_written": sum(r["written"] for r in results),
                "session_tokens_written": results[-1]["tokens_written"],
                "batch_size": max(r["batch"] for r in results),
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
    from lstmem_peft.tuner.history import memory_layers

    digest = hashlib.sha256()
    for layer in memory_layers(loaded.model):
        for name, p in sorted(layer.state_dict().items()):
            digest.update(name.encode())
            digest.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]
