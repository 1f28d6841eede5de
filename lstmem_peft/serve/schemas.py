"""Request bodies of the OpenAI-compatible endpoints and the memory endpoints (pydantic models).

Every field a request may carry is declared: an unknown field, or a known one this server does not
implement (``tools``, ``logit_bias``, a ``response_format`` other than text, ``suffix``, nonzero
penalties, ...), is refused with a 400 error that names it, never ignored (``user`` and
``metadata`` are accepted: they tag a request and change nothing it generates). Values out of range are
400 errors too. Sizes are bounded: ``n`` (:data:`MAX_N`), stop strings (:data:`MAX_STOP` of at most
:data:`MAX_STOP_CHARS` characters), prompts per completions request (:data:`MAX_PROMPTS`) and
``logprobs`` / ``top_logprobs`` (:data:`MAX_LOGPROBS`); ``max_tokens`` is bounded by the context
window (checked by the app).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_N = 8
MAX_STOP = 16  # OpenAI takes 4; lm-eval's generation tasks may send more (their stop words + EOS)
MAX_STOP_CHARS = 1000
MAX_PROMPTS = 128  # prompts per /v1/completions request, times n
MAX_LOGPROBS = 20


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
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None

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
    def _no_bias(cls, value):
        if value:
            _unsupported("logit_bias")
        return value

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


class MemoryWriteRequest(BaseModel):
    """``POST /v1/memory/{session}/write``: ``text`` (written as it is) or ``messages`` (in the chat
    format, and recorded as written, so a later chat that re-sends them does not write them again)."""

    model_config = ConfigDict(extra="forbid")
    text: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _one_of(self):
        if (self.text is None) == (self.messages is None):
            raise ValueError("pass exactly one of 'text' or 'messages'")
        if self.text is not None and not self.text:
            raise ValueError("'text' is empty")
        return self
