"""The bodies of ``lstmem serve``'s own routes: a session's memory (``/v1/memory/{session}/...``:
write, inspect, reset, export, import; its versions and forks) and the list of sessions
(``/v1/sessions``). Pydantic models, declared as the routes' bodies and ``response_model`` as in
:mod:`.protocol` (which holds the OpenAI-shaped bodies, the shared parts and the error shape), so
``/openapi.json`` documents them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .protocol import MAX_VERSION, ChatMessage, WritePolicy


# ---------------------------------------------------------------------- requests
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


# ---------------------------------------------------------------------- responses: memory and sessions
class MemoryWriteResponse(BaseModel):
    """``POST /v1/memory/{session}/write``."""

    session: str
    tokens_written: int = Field(description="tokens this request wrote")
    session_tokens_written: int = Field(description="tokens the session's memory holds after it")


class LayoutInfo(BaseModel):
    """The memory layout every session's cache has (:class:`~lstmem_peft.MemoryLayout`)."""

    model_config = ConfigDict(extra="allow")
    layer_indices: list[int] = Field(description="backbone decoder layers that carry memory")
    num_heads: int
    head_dim: int
    state_dtype: str
    identity: str = Field(description="names the adapter; part of the fingerprint")


class LayerStats(BaseModel):
    """One memory layer of a session: state norms now, gate means of the latest write."""

    layer_index: int
    cell_norm: float = Field(description="||C|| (Frobenius)")
    hidden_norm: float = Field(description="||D|| (Frobenius)")
    out_gate_mean: float | None = Field(description="mean output gate o of the latest write, if any")
    depth_gate_mean: float | None = Field(description="mean depth gate g of the latest write, if any")


class GateMeans(BaseModel):
    """Mean gates of one write, one value per memory layer."""

    out_gate: list[float]
    depth_gate: list[float]


class StateNorms(BaseModel):
    """``||C||`` and ``||D||`` per memory layer after a commit (empty lists before any write)."""

    cell: list[float]
    hidden: list[float]


class TurnRecord(BaseModel):
    """One commit of a session, as its record keeps it (what the page plots)."""

    model_config = ConfigDict(extra="allow")
    kind: str = Field(description="chat, completion, write or import")
    input: str = Field(description="the end of what was sent (at most 500 characters)")
    answer: str = Field(description="the first choice's answer (empty for writes and imports)")
    written: int = Field(description="tokens this commit wrote")
    write: WritePolicy | None = Field(
        None, description="chat and completion turns: the write policy applied (lstmem_write)"
    )
    rolled_back_to: int | None = Field(
        None,
        description="chat and completion turns: the older version the turn continued from (null: the newest)",
    )
    new_messages: list[int] | None = Field(
        None, description="chat turns: the indices of the request's messages the turn took in as new"
    )
    new_text_from: int | None = Field(
        None, description="completion turns: the character of the prompt from which it was new"
    )
    prompt_tokens: int
    batch: int = Field(description="requests in the batch it ran in")
    gates: GateMeans | None
    time: float = Field(description="Unix time of the commit")
    tokens_written: int = Field(description="tokens the memory holds after the commit")
    norms: StateNorms

    def stored(self) -> dict:
        """The record as a session's ``record.json`` holds it (:mod:`.store`): the fields that were set
        (a write or an import has no ``write``, ``rolled_back_to``, ...), in the record's own order
        (:data:`STORED_ORDER`), then any others."""
        data = self.model_dump(exclude_unset=True)
        return {**{k: data.pop(k) for k in STORED_ORDER if k in data}, **data}


#: The order of a turn record's keys in ``record.json``: what was asked and answered, how it ran, what
#: the turn took in as new, then the commit (:meth:`TurnRecord.stored`).
STORED_ORDER = (
    "kind",
    "input",
    "answer",
    "written",
    "write",
    "prompt_tokens",
    "batch",
    "gates",
    "rolled_back_to",
    "new_messages",
    "new_text_from",
    "time",
    "tokens_written",
    "norms",
)


class MemoryInfo(BaseModel):
    """``GET /v1/memory/{session}``: what a session's memory holds and how it got there."""

    session: str
    exists: bool = Field(description="whether anything was committed")
    tokens_written: int
    commit: int = Field(description="commits so far (0: nothing committed)")
    messages_written: int = Field(
        description="chat messages written into memory (messages a turn with lstmem_write 'none' read are "
        "recorded, not counted)"
    )
    layout: LayoutInfo
    fingerprint: str = Field(description="of the layout: a memory file must match it to load")
    adapter_fingerprint: str = Field(description="SHA-256 (16 hex) of the memory layers' weights")
    state_bytes: int
    layers: list[LayerStats]
    turns: list[TurnRecord]


class MemoryDeleteResponse(BaseModel):
    """``DELETE /v1/memory/{session}``."""

    session: str
    deleted: bool = Field(description="whether the session existed")


class MemoryImportResponse(BaseModel):
    """``PUT /v1/memory/{session}/import``."""

    session: str
    tokens_written: int = Field(description="tokens the imported memory holds")


class VersionInfo(BaseModel):
    """One kept version of a session (``GET /v1/memory/{session}/versions``)."""

    version: int = Field(description="its number: the session's commit counter when it was committed")
    current: bool = Field(description="whether it is the newest version (never pruned)")
    messages: int = Field(description="chat messages it had taken in")
    turns: int = Field(description="commits in its record (the turn history up to it)")
    tokens_written: int = Field(description="tokens its memory holds")
    bytes: int = Field(description="size of its memory file (0: nothing written; a file may be shared)")
    time: float = Field(description="Unix time of its commit")


class VersionList(BaseModel):
    """``GET /v1/memory/{session}/versions``: the kept versions, oldest first, and the bounds."""

    object: Literal["list"] = "list"
    session: str
    current: int = Field(description="the newest version (0: nothing committed)")
    max_versions: int = Field(description="most versions kept per session (--session-versions)")
    max_version_bytes: int = Field(
        description="most memory-file bytes kept per session (--session-version-bytes)"
    )
    data: list[VersionInfo]


class ForkRequest(BaseModel):
    """``POST /v1/memory/{session}/fork``: a new session from a kept version of this one."""

    model_config = ConfigDict(extra="forbid")
    version: int = Field(ge=1, le=MAX_VERSION, description="the kept version to fork")
    to: str = Field(description="the new session's id (letters, digits, '.', '_', '-'); it must not exist")


class ForkResponse(BaseModel):
    """``POST /v1/memory/{session}/fork``."""

    session: str = Field(description="the new session")
    source: str
    version: int = Field(description="the version forked: the new session's one version, the same number")
    tokens_written: int


class VersionDeleteResponse(BaseModel):
    """``DELETE /v1/memory/{session}/versions/{version}``."""

    session: str
    version: int
    deleted: bool = True
    versions: list[int] = Field(description="the versions still kept")


class SessionSummary(BaseModel):
    id: str
    tokens_written: int
    turns: int = Field(description="commits in the record")
    commit: int


class SessionList(BaseModel):
    """``GET /v1/sessions``: the caller's committed sessions."""

    object: Literal["list"] = "list"
    data: list[SessionSummary]
