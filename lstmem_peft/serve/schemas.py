"""Request bodies of the OpenAI-compatible endpoints and the memory endpoints (pydantic models).

Unknown fields that OpenAI clients send (``frequency_penalty``, ``logprobs``, ...) are accepted and
ignored; the fields below are validated, and a value out of range is a 400 error.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_N = 8
MAX_STOP = 4


class TextPart(BaseModel):
    """A text part of a message's content list (the only part type a text model can take)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message; a content list of text parts is joined into one string."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


Stop = str | Annotated[list[str], Field(max_length=MAX_STOP)] | None


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stop: Stop = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream_options: dict | None = None

    @field_validator("stop")
    @classmethod
    def _stops_not_empty(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return value

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(_Sampling):
    """``POST /v1/completions`` (one prompt per request)."""

    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    max_tokens: int | None = Field(16, ge=1)

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


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
