"""The memory routes, this server's own (:class:`ServingMemory`): write text or messages into a
session, read what it holds, reset, export and import its memory file, list the sessions, list,
prune and fork its versions.

Writes, resets, imports, forks and prunes are scheduler jobs (the worker owns every session change,
so they queue behind the session's turns); reads, exports and the lists read the store directly.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict

from fastapi import Request
from fastapi.responses import Response

from lstmem_peft.memory.cache import MemoryCache

from .jobs import ForkSession, ImportMemory, Job, PruneVersion, ResetSession, WriteMemory
from .loading import LoadedModel
from .memories import state_norms
from .metrics import Metrics
from .protocol import (
    ServeError,
)
from .protocol_memory import (
    ForkRequest,
    ForkResponse,
    LayerStats,
    LayoutInfo,
    MemoryDeleteResponse,
    MemoryImportResponse,
    MemoryInfo,
    MemoryWriteRequest,
    MemoryWriteResponse,
    SessionList,
    SessionSummary,
    VersionDeleteResponse,
    VersionInfo,
    VersionList,
)
from .scheduler import Scheduler
from .serving_base import ServingBase, valid_session
from .store import Session, SessionStore
from .vocabulary import Vocabulary


class ServingMemory(ServingBase):
    """The memory endpoints of one store.

    Args:
        loaded, scheduler, metrics, vocabulary: see :class:`~.serving_base.ServingBase`.
        store: the sessions.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        scheduler: Scheduler,
        metrics: Metrics,
        store: SessionStore,
        vocabulary: Vocabulary | None = None,
    ) -> None:
        super().__init__(loaded, scheduler, metrics, vocabulary)
        self.store = store

    async def write(self, namespace: str, session: str, body: MemoryWriteRequest) -> MemoryWriteResponse:
        """``POST /v1/memory/{session}/write``: text as it is, or messages in the chat format (then
        recorded as written, so a chat that re-sends them does not write them again)."""
        valid_session(session)
        if body.messages is not None:  # text the model cannot read is refused, not written as padding
            self.vocabulary.check_texts(
                [(f"messages[{i}].content", m.text()) for i, m in enumerate(body.messages)], "messages"
            )
        else:
            self.vocabulary.check_texts([("text", body.text)], "text")
        if body.messages is not None:
            request = WriteMemory(
                display=body.messages[-1].text()[-500:],
                messages=[{"role": m.role, "content": m.text()} for m in body.messages],
            )
        else:
            request = WriteMemory(display=body.text[-500:], text=body.text)
        result = await self.run(Job(request, namespace, session))
        self.metrics.tokens.labels(kind="memory").inc(result["written"])
        return MemoryWriteResponse(
            session=session, tokens_written=result["written"], session_tokens_written=result["tokens_written"]
        )

    def info(self, namespace: str, session: str) -> MemoryInfo:
        """``GET /v1/memory/{session}``: tokens written, layout, fingerprints, per-layer state norms
        and gate means, the turn history."""
        valid_session(session)
        s = self.store.get(namespace, session)
        layout = self.loaded.layout
        return MemoryInfo(
            session=session,
            exists=s.version > 0,
            tokens_written=s.tokens_written,
            commit=s.version,
            messages_written=sum(m.get("written", True) for m in s.messages),
            layout=LayoutInfo(**{**asdict(layout), "layer_indices": list(layout.layer_indices)}),
            fingerprint=layout.fingerprint(),
            adapter_fingerprint=self.loaded.adapter_fingerprint,
            state_bytes=0 if s.memory is None else s.memory.nbytes,
            layers=self._layers(s),
            turns=s.turns,
        )

    def _layers(self, s: Session) -> list[LayerStats]:
        """Each memory layer's state norms now, and its gate means in the latest write that has them."""
        norms = state_norms(s.memory) if s.memory is not None else {"cell": [], "hidden": []}
        gates = next((t.gates for t in reversed(s.turns) if t.gates is not None), None)
        return [
            LayerStats(
                layer_index=index,
                cell_norm=norms["cell"][i] if norms["cell"] else 0.0,
                hidden_norm=norms["hidden"][i] if norms["hidden"] else 0.0,
                out_gate_mean=gates.out_gate[i] if gates else None,
                depth_gate_mean=gates.depth_gate[i] if gates else None,
            )
            for i, index in enumerate(self.loaded.layout.layer_indices)
        ]

    async def delete(self, namespace: str, session: str) -> MemoryDeleteResponse:
        """``DELETE /v1/memory/{session}``: forget the session (memory and record)."""
        valid_session(session)
        result = await self.run(Job(ResetSession(), namespace, session))
        return MemoryDeleteResponse(session=session, deleted=result["deleted"])

    def export(self, namespace: str, session: str) -> Response:
        """``GET /v1/memory/{session}/export``: the bytes of the session's memory file (what
        ``MemoryCache.save`` wrote)."""
        valid_session(session)
        for _ in range(3):  # a commit may replace the file between the lookup and the read
            path = self.store.memory_path(namespace, session)
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

    async def import_(self, namespace: str, session: str, request: Request) -> MemoryImportResponse:
        """``PUT /v1/memory/{session}/import``: replace the session with the memory file in the
        request's body (an export: one row of this adapter's layout; another layout or adapter is
        refused with 409)."""
        valid_session(session)  # before reading the body
        data = await request.body()
        if not data:
            raise ServeError(400, "the body is empty: send the bytes of a MemoryCache file (an export)")
        memory = self._load(data)
        if memory.batch_size != 1:
            raise ServeError(
                400, f"the file holds {memory.batch_size} sessions; import one session's memory (one row)"
            )
        result = await self.run(Job(ImportMemory(memory), namespace, session))
        return MemoryImportResponse(session=session, tokens_written=result["tokens_written"])

    def _load(self, data: bytes) -> MemoryCache:
        """The uploaded bytes as a cache of the served layout; a bad or foreign file is a 400/409
        error whose message names "the uploaded file", not the temporary path."""
        fd, tmp = tempfile.mkstemp(suffix=".safetensors")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            try:
                return MemoryCache.load(tmp, layout=self.loaded.layout)
            except ValueError as err:
                message = str(err).replace(tmp, "the uploaded file")
                raise ServeError(
                    409 if "was saved for" in message else 400, message, code="incompatible_memory"
                ) from None
        finally:
            os.unlink(tmp)

    def versions(self, namespace: str, session: str) -> VersionList:
        """``GET /v1/memory/{session}/versions``: the kept versions, oldest first (none for a session
        that does not exist, as ``GET /v1/memory/{session}`` answers ``exists: false``)."""
        valid_session(session)
        s = self.store.get(namespace, session)
        return VersionList(
            session=session,
            current=s.version,
            max_versions=self.store.max_versions,
            max_version_bytes=self.store.max_version_bytes,
            data=[
                VersionInfo(
                    version=v["version"],
                    current=v["version"] == s.version,
                    messages=v["messages"],
                    turns=v["turns"],
                    tokens_written=v["tokens_written"],
                    bytes=v["bytes"],
                    time=v["time"],
                )
                for v in s.versions
            ],
        )

    async def prune(self, namespace: str, session: str, version: int) -> VersionDeleteResponse:
        """``DELETE /v1/memory/{session}/versions/{version}``: drop a kept version (404 when it is
        not kept, 409 for the newest, which is always kept)."""
        valid_session(session)
        result = await self.run(Job(PruneVersion(version), namespace, session))
        return VersionDeleteResponse(session=session, version=version, versions=result["versions"])

    async def fork(self, namespace: str, session: str, body: ForkRequest) -> ForkResponse:
        """``POST /v1/memory/{session}/fork``: a new session (``to``, in the caller's namespace) whose
        one version is a kept version of this one (404 when it is not kept, 409 when ``to`` exists)."""
        valid_session(session)
        try:
            valid_session(body.to)
        except ServeError as err:
            raise ServeError(400, err.message, code="invalid_session_id", param="to") from None
        result = await self.run(Job(ForkSession(body.version, body.to), namespace, session))
        return ForkResponse(
            session=body.to,
            source=session,
            version=result["version"],
            tokens_written=result["tokens_written"],
        )

    def sessions(self, namespace: str) -> SessionList:
        """``GET /v1/sessions``: the caller's committed sessions."""
        return SessionList(data=[SessionSummary(**summary) for summary in self.store.list(namespace)])
