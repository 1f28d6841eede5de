"""The wire protocol of ``lstmem serve``: every request and response body, as pydantic models.

One module holds what travels over HTTP, in OpenAI's shapes where OpenAI has one (as vLLM's
``entrypoints/openai/protocol.py`` does): the routes take the request models as bodies and declare
the response models as their ``response_model``, so the OpenAPI schema at ``/openapi.json``
documents both. The memory routes (``/v1/memory/...``, ``/v1/sessions``) are this server's own
(:mod:`.protocol_memory`).

Requests: every field a request may carry is declared: an unknown field, or a known one this
server does not implement (``tools``, a ``response_format`` other than text, ``suffix``, nonzero
penalties, ...), is refused with a 400 error that names it, never ignored (``user`` and ``metadata``
are accepted: they tag a request and change nothing it generates). Values out of range are 400
errors too. Sampling fields: OpenAI's (``temperature``, ``top_p``, ``n``, ``stop``, ``seed``,
``logit_bias``) and two of vLLM's that load generators send (``min_tokens``, ``ignore_eos``). Two
fields are this server's own: ``lstmem_write`` (:data:`WritePolicy`), what a chat or completions turn
writes into memory, and ``lstmem_version``, the session version the request's conversation continues
(so an edited conversation replaces the old one). Sizes are bounded: ``n`` (:data:`MAX_N`), stop
strings (:data:`MAX_STOP` of at most :data:`MAX_STOP_CHARS` characters), prompts per completions
request (:data:`MAX_PROMPTS`), ``logprobs`` / ``top_logprobs`` (:data:`MAX_LOGPROBS`) and
``logit_bias`` (:data:`MAX_LOGIT_BIAS` tokens, each bias within :data:`LOGIT_BIAS_LIMIT`);
``max_tokens`` is bounded by the context window, ``min_tokens`` by ``max_tokens`` and
``logit_bias``'s token ids by the vocabulary (checked by the serving classes).

Responses: a completion (:class:`ChatCompletionResponse`, :class:`CompletionResponse`) or a stream
of chunks (:class:`ChatCompletionChunk`, :class:`CompletionChunk`), each with OpenAI's ``usage`` and
this server's ``lstmem`` field (:class:`MemoryUsage`); errors are one shape,
:class:`ErrorResponse`, raised as :class:`ServeError`. The bodies of the memory and session routes,
this server's own, are in :mod:`.protocol_memory`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

MAX_N = 8
MAX_STOP = 16  # OpenAI takes 4; lm-eval's generation tasks may send more (their stop words + EOS)
MAX_STOP_CHARS = 1000
MAX_PROMPTS = 128  # prompts per /v1/completions request, times n
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # tokens a logit_bias may name
LOGIT_BIAS_LIMIT = 100.0  # |bias| at most this, as OpenAI's
#: The largest version number a request may name (a session's commit counter never gets near it).
MAX_VERSION = 2**53

FinishReason = Literal["stop", "length"]

#: What a chat or completions turn writes into its session's memory (the ``lstmem_write`` field):
#: ``none`` reads memory and leaves it as it was, ``messages`` (the default) writes the request's new
#: messages (or prompt text), ``messages_and_answer`` writes them and then the answer. See
#: :mod:`lstmem_peft.serve.runner` for the rule and docs/serving.md for why the default is ``messages``.
WritePolicy = Literal["none", "messages", "messages_and_answer"]
WRITE_POLICIES: tuple[str, ...] = ("none", "messages", "messages_and_answer")
DEFAULT_WRITE: WritePolicy = "messages"
WRITE_DESCRIPTION = (
    "lstmem: what this turn writes into the session's memory. 'none': the answer reads memory and nothing is "
    "written (the new messages are recorded as read, so a conversation sent again later does not write them); "
    "'messages' (default): the request's new messages (completions: the new prompt text) are written, and an "
    "answer is written when a later request sends it back; 'messages_and_answer': the new messages and then "
    "the answer (completions: the completion) are written by this turn (needs n = 1). OpenAI SDKs pass it in "
    "extra_body."
)
VERSION_DESCRIPTION = (
    "lstmem: the session version this conversation continues: send back the lstmem.version of the response "
    "you continue (needs X-Session-Id; chat: send the whole conversation). The messages (completions: the "
    "text) shared with that version are skipped; where the request first differs from it (an edited "
    "message, the first one included), the turn rolls back to the version before and writes the rest as new, "
    "so the session equals one that got only the kept turns. A version that is not kept is 404, nothing "
    "written. Without it, messages shared with the session's newest version from the first one on are "
    "skipped and a conversation that does not start with them is taken as new messages."
)


# ---------------------------------------------------------------------- errors
class ErrorInfo(BaseModel):
    """What went wrong: OpenAI's error object."""

    message: str = Field(description="what went wrong, and the fix where there is one")
    type: str = Field(description="``invalid_request_error`` (4xx) or ``server_error`` (5xx)")
    param: str | None = Field(None, description="the request parameter at fault, if one is")
    code: str | None = Field(None, description="a stable name of the error, e.g. ``context_length_exceeded``")


class ErrorResponse(BaseModel):
    """The body of every 4xx/5xx answer (and of a stream's error event): ``{"error": {...}}``."""

    error: ErrorInfo


class ServeError(Exception):
    """An error with an HTTP status and an OpenAI error type/code, sent to the client as an
    :class:`ErrorResponse` (by the app's exception handler, or as a stream's error event).

    Args:
        status: the HTTP status (4xx: the request; 5xx: the server).
        message: what went wrong, and the fix where there is one.
        type: OpenAI's error type.
        code: a stable name of the error (``model_not_found``, ``context_length_exceeded``, ...).
        param: the request parameter at fault.
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    def body(self) -> ErrorResponse:
        """The error as the client receives it."""
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        )


# ---------------------------------------------------------------------- requests


class TextPart(BaseModel):
    """A text part of a message's content list (the only part type a text model can take)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message; a content list of text parts is joined into one string. Other fields of a
    message (``name``, ``refusal``, ...) are not rendered; tool calls are refused."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[Any] | None = None

    @field_validator("tool_calls")
    @classmethod
    def _no_tool_calls(cls, value):
        if value:
            raise ValueError("tool calls are not supported by this server (no function calling)")
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


def _unsupported(what: str):
    raise ValueError(f"{what} is not supported by this server")


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)  # 0: the smallest nucleus, the most likely token (greedy)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = Field(
        None,
        description="OpenAI's: token id (a string of digits) -> a bias in [-100, 100] added to that token's "
        "logit before sampling (before temperature and top_p)",
    )
    min_tokens: int = Field(
        0,
        ge=0,
        description="vLLM's: the EOS tokens are ruled out, and stop strings not looked for, until this many "
        "tokens were generated (at most max_tokens)",
    )
    ignore_eos: bool = Field(
        False, description="vLLM's: an EOS token does not end the answer; decoding goes on to max_tokens"
    )
    user: str | None = None
    metadata: dict[str, str] | None = None
    # not a sampling parameter: what the turn writes into memory (chat and completions share it)
    lstmem_write: WritePolicy = Field(DEFAULT_WRITE, description=WRITE_DESCRIPTION)
    lstmem_version: int | None = Field(None, ge=0, le=MAX_VERSION, description=VERSION_DESCRIPTION)

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value):
        if value is None:
            return value
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError(f"stop must be a string or a list of at most {MAX_STOP} strings")
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings are allowed, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return value

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, value, info):
        if value:
            _unsupported(f"{info.field_name} (other than 0)")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, value):
        if not value:
            return value
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} tokens may be biased, got {len(value)}")
        for token, bias in value.items():
            if not token.isascii() or not token.isdigit():
                raise ValueError(f"keys are token ids (strings of digits), got {token!r}")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(
                    f"values are biases from -{LOGIT_BIAS_LIMIT:g} to {LOGIT_BIAS_LIMIT:g}, got {bias} for token "
                    f"{token}"
                )
        return value

    def logit_biases(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as ``(token_id, bias)`` pairs, ids ascending (two keys of one id, ``"7"`` and
        ``"07"``, keep the last one sent)."""
        biases = {int(token): float(bias) for token, bias in (self.logit_bias or {}).items()}
        return tuple(sorted(biases.items()))

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def greedy(self) -> bool:
        """Temperature 0, or ``top_p`` 0 (a nucleus of the single most likely token)."""
        return self.temperature == 0.0 or self.top_p == 0.0


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, value, info):
        if value:
            _unsupported(f"{info.field_name} (function calling)")
        return value

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, value, info):
        if value not in (None, "none"):
            _unsupported(f"{info.field_name} other than 'none' (function calling)")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value):
        if value is not None and value != {"type": "text"}:
            _unsupported('a response_format other than {"type": "text"} (no JSON mode or schemas)')
        return value


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: one prompt, or a list of them (text or token ids)."""

    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value):
        shape = "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists"
        if isinstance(value, str):
            return value
        if not isinstance(value, list) or not value:
            raise ValueError(shape if not isinstance(value, list) else "prompt is an empty list")

        def token_ids(ids) -> bool:
            return all(isinstance(t, int) and not isinstance(t, bool) for t in ids)

        if all(isinstance(p, str) for p in value):
            prompts = value
        elif token_ids(value):
            prompts = [value]
        elif all(isinstance(p, list) and token_ids(p) for p in value):
            prompts = value
        else:
            raise ValueError(shape)
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            if not isinstance(p, str) and min(p) < 0:
                raise ValueError(f"prompt {i} has a negative token id")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value:
            _unsupported("suffix (insertion)")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The prompts: each a text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(t, int) for t in p):
            return [list(p)]
        return list(p)


# ---------------------------------------------------------------------- responses: shared parts
class Usage(BaseModel):
    """OpenAI's token counts of one request (every prompt and every choice of it)."""

    prompt_tokens: int = Field(description="tokens of the prompts in the context window")
    completion_tokens: int = Field(description="tokens generated, over every choice")
    total_tokens: int


class MemoryUsage(BaseModel):
    """The ``lstmem`` field of a completion: what the request did to memory."""

    session: str | None = Field(description="the request's X-Session-Id; null: a fresh memory, not stored")
    memory_tokens_written: int = Field(description="tokens this request wrote into memory")
    session_tokens_written: int = Field(description="tokens the session's memory holds after the request")
    batch_size: int = Field(description="requests in the largest batch this one ran in")
    write: WritePolicy = Field(
        description="the write policy applied (the request's lstmem_write; 'none' for a completion that only "
        "scores its prompt, which never writes)"
    )
    version: int | None = Field(
        None,
        description="the session's version this request committed (null: no session, or a completion that "
        "only scores its prompt and commits nothing)",
    )
    rolled_back_to: int | None = Field(
        None,
        description="the older version the turn continued from (an edited or regenerated conversation, or the "
        "request's lstmem_version: the versions after it were dropped); null: it continued the newest version",
    )
    new_messages: list[int] | None = Field(
        None,
        description="chat: the indices of the request's messages this turn took in as new (written, or read "
        "under lstmem_write 'none'), after the version it continued; the others were in that version",
    )
    new_text_from: int | None = Field(
        None,
        description="completions: the character of the prompt's text from which the turn took it in as new "
        "(0: the whole prompt); what comes before was in the version it continued",
    )
    note: str | None = Field(
        None,
        description="said when a request without lstmem_version shares nothing with the session it continues: "
        "everything was taken in as new, not as an edit",
    )


class ModelCard(BaseModel):
    """``GET /v1/models/{model}``: the served model (one per server)."""

    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "lstmem"


class ModelList(BaseModel):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class _Chunk(BaseModel):
    """A streamed chunk: ``usage`` appears only in the chunk that carries it (the last one, with
    ``stream_options.include_usage``), as OpenAI streams it; other chunks have no such key. So does
    this server's ``lstmem`` (:class:`MemoryUsage`): in the chunk that ends the last choice, once the
    turn was committed, with the ``version`` to send back as ``lstmem_version``."""

    lstmem: MemoryUsage | None = Field(
        None, description="in the chunk that ends the last choice only: what the request did to memory"
    )

    @model_serializer(mode="wrap")
    def _omit_missing_usage(self, handler):
        data = handler(self)
        for key in ("usage", "lstmem"):
            if key in data and data[key] is None:
                del data[key]
        return data


# ---------------------------------------------------------------------- responses: chat
class TopLogprob(BaseModel):
    """One of the most likely tokens at a position."""

    token: str
    logprob: float = Field(description="log-probability; -9999 for a token the model rules out (-inf)")
    bytes: list[int] = Field(description="the token's UTF-8 bytes")


class ChatTokenLogprob(TopLogprob):
    """An answer token with its log-probability and the most likely tokens at its position."""

    top_logprobs: list[TopLogprob] = Field(description="best first; empty without top_logprobs")


class ChatLogprobs(BaseModel):
    """``choices[i].logprobs`` of a chat completion: one entry per answer token (the EOS that ended
    the answer is not one)."""

    content: list[ChatTokenLogprob]
    refusal: None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    """``POST /v1/chat/completions`` without ``stream``."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    lstmem: MemoryUsage


class ChatDelta(BaseModel):
    """What a chunk adds to a choice's message: only the keys that change (``role`` in the first
    chunk, ``content`` in the text chunks, nothing in the last one)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _only_what_changes(self, handler):
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(_Chunk):
    """One server-sent event of ``POST /v1/chat/completions`` with ``stream``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# ---------------------------------------------------------------------- responses: completions
class CompletionLogprobs(BaseModel):
    """``choices[i].logprobs`` of a completion (OpenAI's completions form), one entry per token:
    the prompt's first (with ``echo``), then the answer's, the EOS that ended it included."""

    tokens: list[str] = Field(description="each token's piece of the text")
    token_logprobs: list[float | None] = Field(description="null for a prompt's first token")
    top_logprobs: list[dict[str, float] | None] = Field(
        description="most likely tokens: text to log-probability"
    )
    text_offset: list[int] = Field(description="characters into the choice's text where each token starts")


class CompletionChoice(BaseModel):
    index: int = Field(description="``i * n + c`` for choice ``c`` of prompt ``i``")
    text: str = Field(description="the answer; with echo, the prompt then the answer")
    finish_reason: FinishReason
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    """``POST /v1/completions`` without ``stream``."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    lstmem: MemoryUsage


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None = None


class CompletionChunk(_Chunk):
    """One server-sent event of ``POST /v1/completions`` with ``stream``."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


# ---------------------------------------------------------------------- the server
class Health(BaseModel):
    """``GET /health``."""

    status: Literal["ok"] = "ok"
    model: str
    queued: int = Field(description="jobs waiting for the worker")
