"""The FastAPI application: middlewares, exception handlers, lifespan, and the routes wired to the
serving classes. Nothing here answers a request itself; where each answer comes from:

* ``/v1/chat/completions``: :class:`~.serving_chat.ServingChat`;
* ``/v1/completions``: :class:`~.serving_completions.ServingCompletions`;
* ``/v1/models``: :class:`~.serving_models.ServingModels`;
* ``/v1/memory/...`` and ``/v1/sessions``: :class:`~.serving_memory.ServingMemory`;
* request and response bodies: :mod:`.protocol`; the worker that batches every job: :mod:`.scheduler`
  (:mod:`.runner` runs them).

Sessions are chosen by the ``X-Session-Id`` header (chat and completions) or the path (memory
routes). With API keys, each key sees only its own sessions (:func:`~.store.namespace_for`).
Errors are OpenAI-style JSON (:class:`~.protocol.ErrorResponse`) with a 4xx/5xx code: a request
that does not validate gets 400 (not FastAPI's 422), naming the parameter.

OpenAI compatibility: ``/v1/completions`` takes a prompt, a list of prompts or token-id prompts,
``echo``, and ``logprobs`` (with ``max_tokens=0`` and ``echo``: scoring only, which reads memory and
writes nothing); ``/v1/chat/completions`` takes ``logprobs`` / ``top_logprobs``. A parameter this
server does not implement is refused with a 400 error naming it (see :mod:`.protocol`).
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Header, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from lstmem_peft.utils.positions import TRAINED_POSITIONS_KEY
from lstmem_peft.utils.version import __version__

from .loading import LoadedModel
from .metrics import Metrics
from .page import PAGE
from .protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
    ServeError,
)
from .protocol_memory import (
    MAX_VERSION,
    ForkRequest,
    ForkResponse,
    MemoryDeleteResponse,
    MemoryImportResponse,
    MemoryInfo,
    MemoryWriteRequest,
    MemoryWriteResponse,
    SessionList,
    VersionDeleteResponse,
    VersionList,
)
from .runner import JobRunner
from .scheduler import Scheduler
from .serving_base import valid_session
from .serving_chat import ServingChat
from .serving_completions import ServingCompletions
from .serving_memory import ServingMemory
from .serving_models import ServingModels
from .store import DEFAULT_VERSION_BYTES, DEFAULT_VERSIONS, SessionStore, namespace_for
from .vocabulary import Vocabulary

log = logging.getLogger(__name__)
#: ``max_tokens`` of a chat request that sets none, unless ``--max-tokens`` says otherwise: at most half
#: the window (create_app).
DEFAULT_MAX_TOKENS = 64

#: The longest default context window, in tokens: a window is prefilled at every turn, and what
#: does not fit it is written into memory, which is what this server is for.
DEFAULT_WINDOW = 4096


# ---------------------------------------------------------------------- the context window
def context_window_of(loaded: LoadedModel, requested: int | None = None) -> int:
    """The context window the server prompts with, in tokens: never more than the model was
    trained for.

    The model's *position limit* is the smaller of

    * ``loaded.trained_positions``: the positions the backbone was trained for
      (:func:`~lstmem_peft.utils.positions.trained_positions`: the config's ``lstmem_trained_positions``, else a
      run-time rope stretch's ``original_max_position_embeddings``, else ``max_position_embeddings``;
      the embedded demo's backbone: 64, although its config allows 4,096);
    * ``loaded.max_positions``: the positions the model takes at all (``max_position_embeddings``;
      with ``--engine vllm`` at most the engine's ``max_model_len - 1``).

    Both engines follow this one rule (:func:`~.loading.load_model` gives both the same facts).

    Past the trained positions a model does not fail: it answers with confident garbage. So:

    * no ``requested`` window: the position limit, at most :data:`DEFAULT_WINDOW` (the default is
      clamped; logged at INFO when the trained length, not the config's limit, set it: the right
      window, nothing to act on; ``lstmem serve``'s start line names the window);
    * a ``requested`` window over the position limit is **refused** (``ValueError`` naming the
      limit, where it comes from, the request and the fix), not clamped: whoever asked for a window
      expects that window, and a smaller one silently changes which messages are in context and
      which only in memory.

    Input longer than the window is never cut off and dropped: chat messages older than the window,
    and a completions prompt's head, are written into memory; a latest chat message (or an echoed
    or scored prompt) that does not fit is refused with 400 ``context_length_exceeded`` naming the
    window (:mod:`.planning`).

    Args:
        loaded: the served model.
        requested: ``--context-window``, or ``None`` for the default.

    Returns:
        the window, in tokens.

    Raises:
        ValueError: ``requested`` is over the position limit.
    """
    if requested is not None and requested < 1:
        raise ValueError(f"--context-window must be a positive number of tokens, got {requested}")
    trained, hard = loaded.trained_positions, loaded.max_positions
    limits = [n for n in (trained, hard) if n is not None]
    limit = min(limits) if limits else None
    default = min(limit, DEFAULT_WINDOW) if limit is not None else DEFAULT_WINDOW
    if requested is not None and limit is not None and requested > limit:
        reasons = []
        if trained is not None and trained == limit:
            reasons.append(
                f"the backbone was trained for {trained} positions (its config's {loaded.trained_from}) and "
                f'answers garbage past them; if it was trained for more, set "{TRAINED_POSITIONS_KEY}" in '
                "its config.json"
            )
        if hard is not None and hard == limit:
            reasons.append(
                f"the model takes {hard} positions (max_position_embeddings; with --engine vllm: the engine's "
                "max_model_len - 1; raise it with --vllm-arg max_model_len=...)"
            )
        raise ValueError(
            f"--context-window {requested} is over the model's position limit {limit}: {'; '.join(reasons)}. "
            f"Pass --context-window {limit} or less, or leave it out (default {default}); write longer text "
            "into memory (POST /v1/memory/{session}/write)"
        )
    if requested is not None:
        return requested
    if trained is not None and trained == default and (hard is None or trained < hard):
        log.info(
            "lstmem serve: context window %d tokens, the positions the backbone was trained for (its config's "
            "%s; the model takes %s): longer conversations are answered from memory",
            default,
            loaded.trained_from,
            hard if hard is not None else "any number",
        )
    return default


# Long on purpose: its docstring is a quarter of it (one entry per argument); the rest checks the
# window and the store, then builds the app's parts and wires them together, one line each.
def create_app(
    loaded: LoadedModel,
    store_dir: str,
    context_window: int | None = None,
    api_keys: list[str] | None = None,
    max_batch: int = 32,
    batch_wait_ms: float = 5.0,
    batching: bool = True,
    max_body_bytes: int = 1 << 20,
    default_max_tokens: int | None = None,
    session_versions: int = DEFAULT_VERSIONS,
    session_version_bytes: int = DEFAULT_VERSION_BYTES,
) -> FastAPI:
    """Build the app around a loaded model.

    Args:
        loaded: :class:`~.loading.LoadedModel`.
        store_dir: where sessions live (created if missing).
        context_window: tokens of the prompt window: at most the positions the backbone was trained
            for (:func:`context_window_of`; over it: ``ValueError``); default: that, at most 4096.
        api_keys: accepted bearer keys; ``None`` or empty: no authentication, one shared namespace.
        max_batch: most sessions per batched forward.
        batch_wait_ms: how long the worker waits for more requests to batch with the first one.
        batching: ``False`` runs requests one at a time (the benchmark's baseline).
        max_body_bytes: larger request bodies get 413.
        default_max_tokens: ``max_tokens`` of chat requests that give none; default: 64, at most half the
            window (the demo's 64-token window: 32). A given one that leaves no room for a prompt in the
            window becomes half the window (with a warning).
        session_versions: most versions kept per session (:mod:`.store`; the newest is always kept).
        session_version_bytes: most bytes of memory files kept per session.

    Returns:
        the app; ``app.state`` holds ``loaded``, ``store``, ``scheduler`` (started and stopped by
        the app's lifespan) and ``metrics``.
    """
    window = context_window_of(loaded, context_window)
    if default_max_tokens is None:  # the defaults fit together: room for a prompt in any window
        default_max_tokens = max(1, min(DEFAULT_MAX_TOKENS, window // 2))
    if default_max_tokens >= window:
        log.warning(
            "lstmem serve: --max-tokens %d leaves no room for a prompt in the %d-token context window; chat "
            "requests that set no max_tokens get %d",
            default_max_tokens,
            window,
            window // 2,
        )
        default_max_tokens = max(1, window // 2)
    root = loaded.engine.session_root  # an engine that reads memories by file reads the store's own
    if root is not None and os.path.realpath(store_dir) != os.path.realpath(root):
        raise ValueError(
            f"the {loaded.engine.name} engine reads and writes session memories in {root}, so the session store "
            f"must be there: pass --store {root} (load_model(..., store=...) and create_app(..., store_dir=...) "
            "take the same folder)"
        )
    metrics = Metrics()
    store = SessionStore(
        store_dir, loaded.layout, max_versions=session_versions, max_version_bytes=session_version_bytes
    )
    runner = JobRunner(loaded.engine, loaded.tokenizer, loaded.device, loaded.eos_ids, store, window)
    scheduler = Scheduler(
        runner,
        max_batch=max_batch,
        batch_wait=batch_wait_ms / 1000,
        batching=batching,
        metrics=metrics,
    )
    app = FastAPI(
        title="lstmem serve",
        version=__version__,
        description="OpenAI-compatible server whose sessions keep a persistent LSTMem memory.",
        lifespan=lifespan,
    )
    state = app.state
    state.loaded, state.store, state.scheduler, state.metrics = loaded, store, scheduler, metrics
    state.api_keys = frozenset(api_keys or ())
    vocabulary = Vocabulary.of(loaded)  # the request handlers' tokenizer, and what text the model reads
    state.serving_models = ServingModels(loaded, scheduler, metrics)
    state.serving_chat = ServingChat(loaded, scheduler, metrics, window, default_max_tokens, vocabulary)
    state.serving_completions = ServingCompletions(loaded, scheduler, metrics, window, vocabulary)
    state.serving_memory = ServingMemory(loaded, scheduler, metrics, store, vocabulary)
    # the last added runs first: metrics see every answer, 413s included
    app.add_middleware(JsonBody)
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    app.middleware("http")(count_requests)
    app.add_exception_handler(ServeError, serve_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.include_router(router)
    return app


@asynccontextmanager
async def lifespan(app: FastAPI):
    """The worker thread runs while the server does."""
    app.state.scheduler.start()
    yield
    app.state.scheduler.stop()


# ---------------------------------------------------------------------- middlewares
def error_json(
    status: int,
    message: str,
    type: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
) -> JSONResponse:
    """An :class:`~.protocol.ErrorResponse` with its status."""
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


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


async def count_requests(request: Request, call_next):
    """HTTP middleware: count each request and its latency by route template and status."""
    metrics: Metrics = request.app.state.metrics
    start = time.perf_counter()
    response = await call_next(request)
    route = getattr(request.scope.get("route"), "path", "unmatched")
    metrics.requests.labels(route=route, status=str(response.status_code)).inc()
    metrics.latency.labels(route=route).observe(time.perf_counter() - start)
    return response


# ---------------------------------------------------------------------- exception handlers
async def serve_error(request: Request, err: ServeError) -> JSONResponse:
    return JSONResponse(err.body().model_dump(), status_code=err.status)


#: Parts of a pydantic error location that name a union member, not a field.
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _where(loc) -> str:
    """The dotted path of the field a validation error is about (``messages.0.role``)."""
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


async def validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
    """A request that does not validate: 400 naming the parameter (``unsupported_parameter`` for
    one this server does not implement), or naming the body when it is not a JSON object."""
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


async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    return error_json(err.status_code, str(err.detail), code="not_found" if err.status_code == 404 else None)


# ---------------------------------------------------------------------- dependencies
def caller_namespace(request: Request, authorization: str | None = Header(None)) -> str:
    """The caller's store namespace: ``public`` without API keys; with keys, the bearer key's own
    (401 for a missing or unknown key)."""
    keys = request.app.state.api_keys
    if not keys:
        return namespace_for(None)
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or key not in keys:
        raise ServeError(
            401, "missing or unknown API key (Authorization: Bearer KEY)", code="invalid_api_key"
        )
    return namespace_for(key)


def session_header(x_session_id: str | None = Header(None)) -> str | None:
    """The ``X-Session-Id`` header, checked; ``None``: a fresh memory that is not stored."""
    return None if x_session_id is None else valid_session(x_session_id)


def _chat(request: Request) -> ServingChat:
    return request.app.state.serving_chat


def _completions(request: Request) -> ServingCompletions:
    return request.app.state.serving_completions


def _models(request: Request) -> ServingModels:
    return request.app.state.serving_models


def _memory(request: Request) -> ServingMemory:
    return request.app.state.serving_memory


# ---------------------------------------------------------------------- routes
router = APIRouter()

#: Every error a route may answer, in the schema: one shape (and no 422: validation errors are 400).
ERRORS = {
    "4XX": {
        "model": ErrorResponse,
        "description": "the request is invalid, unsupported, unauthorised or too large",
    },
    "5XX": {"model": ErrorResponse, "description": "the server failed; the session was not changed"},
}
#: A generation route's 200 answer with ``stream``: server-sent chunk events, then ``data: [DONE]``.
STREAMED = {
    **ERRORS,
    200: {
        "description": "the completion; with stream=true, server-sent events `data: <chunk>` (protocol's "
        "ChatCompletionChunk or CompletionChunk: the text as it comes, usage last), then `data: [DONE]`",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    },
}


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=STREAMED)
async def create_chat_completion(
    body: ChatCompletionRequest,
    request: Request,
    namespace: str = Depends(caller_namespace),
    session: str | None = Depends(session_header),
):
    return await _chat(request).create(body, namespace, session)


@router.post("/v1/completions", response_model=CompletionResponse, responses=STREAMED)
async def create_completion(
    body: CompletionRequest,
    request: Request,
    namespace: str = Depends(caller_namespace),
    session: str | None = Depends(session_header),
):
    return await _completions(request).create(body, namespace, session)


@router.get("/v1/models", response_model=ModelList, responses=ERRORS)
async def list_models(request: Request, namespace: str = Depends(caller_namespace)):
    return _models(request).list_models()


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERRORS)
async def retrieve_model(model_id: str, request: Request, namespace: str = Depends(caller_namespace)):
    return _models(request).retrieve(model_id)


@router.post("/v1/memory/{session}/write", response_model=MemoryWriteResponse, responses=ERRORS)
async def memory_write(
    session: str, body: MemoryWriteRequest, request: Request, namespace: str = Depends(caller_namespace)
):
    return await _memory(request).write(namespace, session, body)


@router.get("/v1/memory/{session}", response_model=MemoryInfo, responses=ERRORS)
async def memory_info(session: str, request: Request, namespace: str = Depends(caller_namespace)):
    return _memory(request).info(namespace, session)


@router.delete("/v1/memory/{session}", response_model=MemoryDeleteResponse, responses=ERRORS)
async def memory_delete(session: str, request: Request, namespace: str = Depends(caller_namespace)):
    return await _memory(request).delete(namespace, session)


MEMORY_FILE = {"schema": {"type": "string", "format": "binary"}}


@router.get(
    "/v1/memory/{session}/export",
    response_class=Response,
    responses={
        **ERRORS,
        200: {"description": "the memory file", "content": {"application/octet-stream": MEMORY_FILE}},
    },
)
async def memory_export(session: str, request: Request, namespace: str = Depends(caller_namespace)):
    return _memory(request).export(namespace, session)


@router.put(
    "/v1/memory/{session}/import",
    response_model=MemoryImportResponse,
    responses=ERRORS,
    openapi_extra={"requestBody": {"required": True, "content": {"application/octet-stream": MEMORY_FILE}}},
)
async def memory_import(session: str, request: Request, namespace: str = Depends(caller_namespace)):
    return await _memory(request).import_(namespace, session, request)


@router.get("/v1/memory/{session}/versions", response_model=VersionList, responses=ERRORS)
async def memory_versions(session: str, request: Request, namespace: str = Depends(caller_namespace)):
    return _memory(request).versions(namespace, session)


@router.delete(
    "/v1/memory/{session}/versions/{version}", response_model=VersionDeleteResponse, responses=ERRORS
)
async def memory_version_delete(
    session: str,
    request: Request,
    version: int = Path(ge=1, le=MAX_VERSION),
    namespace: str = Depends(caller_namespace),
):
    return await _memory(request).prune(namespace, session, version)


@router.post("/v1/memory/{session}/fork", response_model=ForkResponse, responses=ERRORS)
async def memory_fork(
    session: str, body: ForkRequest, request: Request, namespace: str = Depends(caller_namespace)
):
    return await _memory(request).fork(namespace, session, body)


@router.get("/v1/sessions", response_model=SessionList, responses=ERRORS)
async def list_sessions(request: Request, namespace: str = Depends(caller_namespace)):
    return _memory(request).sessions(namespace)


@router.get("/health", response_model=Health)
async def health(request: Request):
    return Health(model=request.app.state.loaded.name, queued=request.app.state.scheduler.queued)


@router.get("/metrics", response_class=PlainTextResponse)
async def prometheus(request: Request):
    state = request.app.state
    state.metrics.sessions.set(len(state.store._sessions))
    state.metrics.queued.set(state.scheduler.queued)
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/", response_class=HTMLResponse)
async def page():
    return PAGE
