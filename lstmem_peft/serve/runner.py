"""Running the jobs the scheduler batches: turns, memory writes, session jobs and scores.

Batches are the scheduler's (:mod:`.scheduler`: jobs of different sessions, one request type and
one decoding setting); what each batch does is here.

A turn (:meth:`JobRunner.run_turns`) reads every new token before it writes it, and writes it
once:

1. the messages of the request that the session has not written yet are found (the written
   record's prefix is skipped; see :func:`.planning.plan_chat`); the prompt is the latest messages
   that fit the context window;
2. new messages that are *not* in the prompt (older than the window) are written into memory
   (``write_history``: blocks + feedback) first: memory is the only place the answer can read them;
3. the answer is generated with memory read-only (``generate(memory_cache=..., memory_write=False)``):
   the prompt in context, memory as it was before this turn's in-context messages;
4. the new messages that are in the prompt are written after answering, in conversation order, in
   one ``write_history`` call; the new memory and record are committed to disk
   (:meth:`~lstmem_peft.serve.store.SessionStore.commit`) before the response (or the stream's last
   event) is sent.

The answer is not written by its own turn: memory holds the conversation as the client keeps it. A
client that sends the whole conversation back (the usual chat client) has the answer written, as a
new message, by its next turn; with ``n > 1`` that is the choice it kept. A client that sends only its
latest message keeps the answers out of memory. So an answer the model made up is never stored unless
the client keeps it.

A completion is the same turn on text (:func:`.planning.plan_completion`): of the prompt's tokens
the session has not written, those before the context window are written before answering, the
rest after it; a completion is written when a later prompt carries it. So a question sent as a turn
is answered from memory as the in-process "write the history, then read the question"
(``lstmem_peft.cli.demo.recall.evaluate``) does, and memory holds each message once, in order.

**The write policy** (the request's ``lstmem_write``, :data:`.protocol.WritePolicy`) decides what
steps 2 and 4 commit; the answer is the same under all three (same prompt, same memory read):

* ``messages`` (the default): as above.
* ``none``: step 2 writes into a copy of the memory that the answer reads and that is then dropped;
  step 4 writes nothing. The session's memory is committed as it was: the same object, so the store
  keeps the same memory file, byte for byte (only ``record.json`` gains the turn). The new messages
  go into the record marked ``written: false``: taken in, not written. The prefix matching skips
  them like written ones, so a client that later sends the whole conversation again, under any
  policy, does not write them. The answer is not recorded: sent back later, it is a new message of
  that request, written or not by that request's policy (as every answer under ``messages``).
  A completion's prompt text joins the record's text chain the same way (read, not written).
* ``messages_and_answer``: step 4 writes the new in-context messages and then the answer, in one
  ``write_history`` call, in conversation order. The answer is written as a client would send it
  back: ``ChatFormat.message("assistant", text)`` in chat, ``encode_text(text)`` for a completion
  (its text after the stop cut). It is recorded (chat: a record entry, hash of role and text;
  completions: it joins the text chain), so a client that sends it back does not write it twice.
  It needs ``n == 1`` (the serving classes refuse more): the one choice is the one the client keeps.
  (``none`` and ``messages`` record no answer, so they take any ``n``.)

The response's ``lstmem`` field names the policy applied and counts the tokens written.

**Versions** (:mod:`.store`): every commit is a new version of its session. A turn whose request
edits or regenerates the conversation (:func:`.planning.plan_chat`), or extends an older version's
completions text (:func:`.planning.plan_completion`), *rolls back*: it runs, by the same four steps,
on that version's memory and record (:meth:`~.store.SessionStore.at_version`, read from its file)
instead of the newest; its commit continues the line from there and drops the versions after it.
So a rolled-back turn leaves the session exactly as the kept turns and the new one, replayed into a
fresh session, would. A request that names the version its conversation continues
(``lstmem_version``: the ``lstmem.version`` of the response it continues) is planned on that version
(:meth:`JobRunner._plan`), so a conversation that differs from it from its first message on (an
edited first message) rolls back too, to the empty session; without it a conversation that shares
no first message with the newest version is taken as new messages. The response's
``lstmem.rolled_back_to`` names the version continued when it is not the newest, ``lstmem.version``
the one the turn committed, and ``lstmem.new_messages`` (``new_text_from``) what the turn took in
as new. Forks (``fork`` jobs:
:meth:`~.store.SessionStore.fork`) and prunes of a version (``prune`` jobs) run on this worker too,
so they never race a turn of their session. Nothing here depends on the engine (:mod:`.engine`):
``--engine vllm`` reads and writes the same store through the same jobs.

A failure anywhere before the commit leaves the session as it was; so does a stream whose client
went away before the commit (the job is marked cancelled, decoding of its rows stops early and
nothing is committed).
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field, replace

import torch

from lstmem_peft.utils.chat import ChatFormat

from .conversation import message_hash
from .engine import Engine, MemoryRow
from .events import Done, Failed
from .generation import Answer, answer_eos_ids, generate_rows, score_rows
from .jobs import (
    ChatTurn,
    CompletionTurn,
    ForkSession,
    ImportMemory,
    Job,
    PruneVersion,
    ResetSession,
    ScorePrompt,
    StreamState,
    WriteMemory,
)
from .memories import fresh_memory, merge_gates, state_norms, write_rows
from .planning import Plan, plan_chat, plan_completion
from .protocol import ServeError
from .protocol_memory import TurnRecord
from .store import Session, SessionStore

log = logging.getLogger("lstmem.serve")


@dataclass
class _Turn:
    """One job of a batch of turns on its way through :meth:`JobRunner.run_turns`.

    Attributes:
        job: the request.
        session: the session as it was before the turn.
        plan: what the turn writes and prompts with.
        streams: with ``job.stream``, one :class:`StreamState` per choice.
        answer_ids: with ``write="messages_and_answer"``, the answer's tokens as written after the
            turn's new in-context messages (:meth:`JobRunner._answer_tokens`); else empty.
    """

    job: Job
    session: Session
    plan: Plan
    streams: list[StreamState] | None = None
    answer_ids: list[int] = field(default_factory=list)


def _written_entry(role: str, content: str, tokens: int) -> dict:
    """A session record's entry for a message a commit wrote (``tokens``: its length in tokens)."""
    return {"hash": message_hash(role, content), "role": role, "tokens": tokens, "written": True}


class JobRunner:
    """Runs a batch of jobs of one request type on the scheduler's worker thread (the turn rule and
    the write policies of this module's docstring); each job gets its result or its error through
    its events.

    Args:
        engine: what answers, scores and writes memory (the served model's :class:`~.engine.Engine`).
        tokenizer: the served model's tokenizer.
        device: where session memories live (``LoadedModel.device``).
        eos_ids: the tokens that end an answer (``LoadedModel.eos_ids``).
        store: the session store (its ``layout`` is every session's, a fresh one's too).
        window: the context window (tokens) of the prompt policy.
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer,
        device: torch.device,
        eos_ids: frozenset[int],
        store: SessionStore,
        window: int,
    ) -> None:
        self.engine, self.tokenizer, self.device = engine, tokenizer, device
        self.eos_ids, self.store, self.window = eos_ids, store, window
        self.fmt = ChatFormat(tokenizer)

    def run(self, jobs: list[Job]) -> None:
        """Run a batch (jobs of one request type: :meth:`~.jobs.Job.key`) by the type of its requests."""
        match jobs[0].request:
            case ChatTurn() | CompletionTurn():
                self.run_turns(jobs)
            case ScorePrompt():
                self.run_scores(jobs)
            case WriteMemory():
                self.run_writes(jobs)
            case ResetSession():
                self.run_resets(jobs)
            case ImportMemory():
                self.run_imports(jobs)
            case ForkSession():
                self.run_forks(jobs)
            case PruneVersion():
                self.run_prunes(jobs)
            case request:
                raise TypeError(f"no runner for a {type(request).__name__} request")

    # ------------------------------------------------------------------ helpers
    def _session(self, job: Job) -> Session:
        if job.session is None:
            return Session(job.namespace, "")
        return self.store.get(job.namespace, job.session)

    def _memory(self, session: Session) -> MemoryRow:
        """The session's memory as the engine takes it (a fresh one when nothing was written)."""
        fresh = None if session.memory is not None else fresh_memory(self.store.layout, self.device)
        return self.store.row(session, fresh)

    def _commit(
        self, job: Job, session: Session, row: MemoryRow | None, changes: dict | None = None, **record
    ) -> Session:
        """Durably commit the next version of a session (nothing for a session-less request): its
        record gains a :class:`~.protocol_memory.TurnRecord` of the fields ``record`` and the commit's
        (time, tokens held, state norms); ``changes``: the other fields of the session that change
        (``messages``, ``completion_text``). ``row`` ``None``: nothing was ever written (a read-only
        turn on a new session)."""
        memory = None if row is None else row.memory
        shown = memory if memory is not None else self._memory(session).memory
        turn = TurnRecord(
            **record,
            time=time.time(),
            tokens_written=int(shown.tokens_written[0]),
            norms=state_norms(shown),
        )
        # a memory the turn did not change keeps its file (the store shares it); a new one gets its own
        kept_file = session.memory_file if memory is not None and memory is session.memory else None
        new = replace(
            session, memory=memory, memory_file=kept_file, turns=session.turns + [turn], **(changes or {})
        )
        if job.session is not None:
            # a memory an engine wrote to a file of the session's folder: that file becomes the version
            self.store.commit(new, written=None if kept_file is not None or row is None else row.file)
        return new

    def _commit_or_report(
        self, job: Job, session: Session, row: MemoryRow | None, changes: dict | None = None, **record
    ) -> Session | None:
        """:meth:`_commit`; a commit that fails is logged and sent to the job as a 500 error, and
        gives ``None`` (the session stays at its previous version, on disk and in RAM)."""
        try:
            return self._commit(job, session, row, changes, **record)
        except Exception as err:  # the store failed (disk, permissions): a server error, not the request's
            log.exception("commit of session %s failed", job.session)
            job.emit(Failed(ServeError(500, f"could not store the session: {err}", type="server_error")))
            return None

    # ------------------------------------------------------------------ turns
    def run_turns(self, jobs: list[Job]) -> None:
        """A batch of chat or completion turns (one decoding setting, one job per session), by the
        turn rule of this module's docstring: write what precedes the prompt, answer with memory
        read-only, write the new part of the prompt, commit. Each job gets its result or its error."""
        turns = self._plan_turns(jobs)
        if not turns:
            return
        start = time.perf_counter()
        memories, finals = [], []
        try:
            # new messages older than the prompt: written first, memory is where the answer reads them
            # (under write "none" into a copy that is dropped after answering: write_rows returns new rows)
            before = [t.plan.before for t in turns]
            memories, gates_in = write_rows(
                self.engine, [self._memory(t.session) for t in turns], before, self.device
            )
            answers = self._answer(turns, memories)
            for turn, choices in zip(turns, answers, strict=True):
                turn.answer_ids = self._answer_tokens(turn, choices)
            # then the new messages that were in the prompt (read, not yet written), once, and with
            # "messages_and_answer" the answer after them; otherwise the answer is written when the
            # client sends it back as part of its conversation (or prompt)
            finals, gates_out = write_rows(
                self.engine,
                memories,
                [[] if t.plan.write == "none" else t.plan.after + t.answer_ids for t in turns],
                self.device,
            )
            elapsed = time.perf_counter() - start
            for i, turn in enumerate(turns):
                if turn.plan.write == "none":  # the session's memory as it was: the copy is dropped
                    kept = None if turn.session.memory is None else MemoryRow(turn.session.memory)
                    self._finish_turn(turn, kept, answers[i], None, len(turns), elapsed)
                    continue
                after = len(turn.plan.after) + len(turn.answer_ids)
                gates = merge_gates(gates_in[i], gates_out[i], len(turn.plan.before), after)
                self._finish_turn(turn, finals[i], answers[i], gates, len(turns), elapsed)
        finally:
            self.store.discard(memories + finals)  # an engine's files that no commit took

    def _answer_tokens(self, turn: _Turn, choices: list[Answer]) -> list[int]:
        """The tokens of the answer a ``messages_and_answer`` turn writes (else none): the answer as a
        client sends it back, its text after the stop cut: a chat message
        (``ChatFormat.message("assistant", text)``) or a completion's text (``encode_text``)."""
        if turn.plan.write != "messages_and_answer":
            return []
        (answer,) = choices  # n == 1: the serving classes refuse more with this policy
        if isinstance(turn.job.request, ChatTurn):
            return self.fmt.message("assistant", answer.text)
        return self.fmt.encode_text(answer.text)

    def _plan_turns(self, jobs: list[Job]) -> list[_Turn]:
        """Each job's plan (:mod:`.planning`); a job whose request does not fit gets its error and
        leaves the batch."""
        max_tokens = jobs[0].sampling.max_tokens
        turns = []
        for job in jobs:
            try:
                session, plan = self._plan(job, self._session(job), max_tokens)
            except ServeError as err:
                job.emit(Failed(err))
                continue
            except (OSError, ValueError) as err:  # a version's file is missing or damaged
                log.exception("rollback of session %s failed", job.session)
                job.emit(Failed(ServeError(500, f"could not read the version: {err}", type="server_error")))
                continue
            turns.append(_Turn(job, session, plan))
        return turns

    def _plan(self, job: Job, session: Session, max_tokens: int) -> tuple[Session, Plan]:
        """A turn's plan and the session at the version it continues: the newest, or the version the
        request names (``lstmem_version``: its conversation continues that one), or an older one the
        plan rolls back to (an edited or regenerated conversation). ``plan.rollback`` is that version
        whenever it is not the newest."""
        request = job.request
        pinned = request.version is not None
        base = self._pinned(session, request.version) if pinned else session
        if isinstance(request, ChatTurn):
            plan = plan_chat(self.fmt, base, request.messages, self.window, max_tokens, request.write, pinned)
        else:
            plan = plan_completion(
                self.fmt, base, request.prompt, self.window, max_tokens, request.write, pinned
            )
        target = base.version if plan.rollback is None else plan.rollback
        if target == session.version:
            return session, plan
        plan.rollback = target
        return (base if target == base.version else self.store.at_version(session, target)), plan

    def _pinned(self, session: Session, number: int) -> Session:
        """``session`` at the version a request names (``lstmem_version``); 404 naming the fixes when
        it is not kept."""
        if number == session.version:
            return session
        try:
            return self.store.at_version(session, number)
        except ServeError as err:
            raise ServeError(
                404,
                f"lstmem_version {number}: {err.message}. Send the lstmem.version of the latest response on "
                f"this session (now {session.version}) or another kept version, or leave lstmem_version out "
                "(the messages the session took in are then skipped by the prefix rule, and a conversation "
                "that does not start with them is taken as new messages)",
                code="version_not_found",
                param="lstmem_version",
            ) from None

    def _answer(self, turns: list[_Turn], memories: list[MemoryRow]) -> list[list[Answer]]:
        """Every turn's choices, generated from its memory read-only (:func:`~.generation.generate_rows`);
        turns that stream get their text deltas as the tokens come, and a cancelled turn's rows stop."""
        sampling = turns[0].job.sampling
        n = sampling.n
        eos_ids = answer_eos_ids(self.eos_ids, sampling)  # none with ignore_eos
        for turn in turns:
            if turn.job.stream:
                turn.streams = [
                    StreamState(turn.job, c, self.tokenizer, sampling.stop, sampling.min_tokens)
                    for c in range(n)
                ]

        def on_token(row: int, token: int) -> None:
            streams = turns[row // n].streams
            if streams is not None:
                streams[row % n].push(token, eos_ids)

        return generate_rows(
            self.engine,
            self.tokenizer,
            self.eos_ids,
            memories,
            [t.plan.prompt for t in turns],
            sampling,
            on_token=on_token if any(t.streams is not None for t in turns) else None,
            cancelled=lambda row: turns[row // n].job.cancelled.is_set(),
        )

    def _finish_turn(
        self,
        turn: _Turn,
        memory: MemoryRow | None,
        choices: list[Answer],
        gates: dict | None,
        batch: int,
        elapsed: float,
    ) -> None:
        """Commit one turn (its new memory, or under write "none" the session's memory as it was,
        and its record) and send its result; a turn whose request was cancelled meanwhile commits
        nothing."""
        job, plan, session = turn.job, turn.plan, turn.session
        if job.cancelled.is_set():
            job.emit(
                Failed(ServeError(499, "request cancelled; the session was not changed", code="cancelled"))
            )
            return
        changes = self._record_changes(turn, choices)
        written = 0 if plan.write == "none" else len(plan.before) + len(plan.after) + len(turn.answer_ids)
        report = self._report(turn)
        new = self._commit_or_report(
            job,
            session,
            memory,
            changes,
            kind=job.request.mode,
            input=job.request.display,
            answer=choices[0].text,
            written=written,
            write=plan.write,
            prompt_tokens=len(plan.prompt),
            batch=batch,
            gates=gates,
            rolled_back_to=plan.rollback,
            **{k: v for k, v in report.items() if k != "note"},
        )
        if new is None:
            return
        if turn.streams is not None:
            for state, choice in zip(turn.streams, choices, strict=True):
                state.finish(choice.text)
        result = {
            "choices": choices,
            "prompt_tokens": len(plan.prompt),
            "written": written,
            "write": plan.write,
            "tokens_written": new.tokens_written,
            "batch": batch,
            "seconds": elapsed,
            "version": new.version if job.session is not None else None,
            "rollback": plan.rollback,
            **report,
        }
        job.emit(Done(result))

    @staticmethod
    def _report(turn: _Turn) -> dict:
        """What the turn took in as new, said plainly: chat, ``new_messages`` (indices of the request's
        messages; the others were in the version it continued); completions, ``new_text_from`` (the
        character of the prompt from which it was new). A ``note`` when the request shares nothing
        with a session that holds a conversation and names no version: it was taken as new, never
        as an edit."""
        request, plan, session = turn.job.request, turn.plan, turn.session
        if isinstance(request, ChatTurn):
            report = {"new_messages": list(range(plan.kept, len(request.messages)))}
            held, what = (
                len(session.messages) > 0 and len(request.messages) > 1,
                "every message was taken in as new, on top of version {}: the conversation does not start with "
                "the session's messages",
            )
        else:
            report = {"new_text_from": plan.kept}
            held, what = (
                session.completion_text["length"] > 0,
                "the whole prompt was taken in as new, on top of version {}: it does not start with the session's text",
            )
        if held and plan.kept == 0 and request.version is None and turn.job.session is not None:
            report["note"] = (
                what.format(session.version) + ". To have an edited conversation replace the old one "
                "instead, send lstmem_version (the lstmem.version of the response it continues): the turn "
                "then rolls back to the version before the first changed message"
            )
        return report

    def _record_changes(self, turn: _Turn, choices: list[Answer]) -> dict:
        """What the turn adds to the session's record: chat, its new messages (marked read, not
        written, under write "none") and with "messages_and_answer" the answer; completions, the
        text chain (the prompt, and with "messages_and_answer" the completion after it)."""
        plan, session = turn.plan, turn.session
        if isinstance(turn.job.request, ChatTurn):
            entries = list(plan.new_messages)
            if plan.write == "messages_and_answer":
                entries.append(_written_entry("assistant", choices[0].text, len(turn.answer_ids)))
            return {"messages": session.messages + entries}
        chain = plan.text_chain + (choices[0].text if plan.write == "messages_and_answer" else "")
        return {
            "completion_text": {"length": len(chain), "sha256": hashlib.sha256(chain.encode()).hexdigest()}
        }

    # ------------------------------------------------------------------ memory writes
    def run_writes(self, jobs: list[Job]) -> None:
        sessions = [self._session(j) for j in jobs]
        tokens = []
        for job in jobs:
            messages = job.request.messages
            if messages is not None:
                tokens.append([t for m in messages for t in self.fmt.message(m["role"], m["content"])])
            else:
                tokens.append(self.fmt.encode_text(job.request.text))
        memories, gates = write_rows(self.engine, [self._memory(s) for s in sessions], tokens, self.device)
        try:
            self._commit_writes(jobs, sessions, memories, tokens, gates)
        finally:
            self.store.discard(memories)  # an engine's files that no commit took

    def _commit_writes(self, jobs, sessions, memories, tokens, gates) -> None:
        for job, session, memory, ids, gate in zip(jobs, sessions, memories, tokens, gates, strict=True):
            changes = {}
            if job.request.messages is not None:
                changes["messages"] = session.messages + [
                    _written_entry(m["role"], m["content"], len(self.fmt.message(m["role"], m["content"])))
                    for m in job.request.messages
                ]
            new = self._commit_or_report(
                job,
                session,
                memory,
                changes,
                kind="write",
                input=job.request.display,
                answer="",
                written=len(ids),
                prompt_tokens=0,
                batch=len(jobs),
                gates=gate,
            )
            if new is not None:
                job.emit(Done({"written": len(ids), "tokens_written": new.tokens_written}))

    def run_resets(self, jobs: list[Job]) -> None:
        for job in jobs:
            existed = self.store.delete(job.namespace, job.session)
            job.emit(Done({"deleted": existed}))

    def run_forks(self, jobs: list[Job]) -> None:
        """:class:`~.jobs.ForkSession`: a new session from a kept version of the job's."""
        for job in jobs:
            forked = self.store.fork(job.namespace, job.session, job.request.version, job.request.to)
            job.emit(Done({"version": forked.version, "tokens_written": forked.tokens_written}))

    def run_prunes(self, jobs: list[Job]) -> None:
        """:class:`~.jobs.PruneVersion`: drop a kept version (never the newest)."""
        for job in jobs:
            pruned = self.store.prune(job.namespace, job.session, job.request.version)
            job.emit(Done({"versions": [v["version"] for v in pruned.versions]}))

    def run_imports(self, jobs: list[Job]) -> None:
        for job in jobs:
            memory = job.request.memory
            session = self._session(job)
            fresh = Session(job.namespace, job.session, created=session.created)
            row = MemoryRow(memory.to(self.device))
            record = dict(input="", answer="", written=0, prompt_tokens=0, batch=1, gates=None)
            new = self._commit(job, fresh, row, kind="import", **record)
            job.emit(Done({"tokens_written": new.tokens_written}))

    # ------------------------------------------------------------------ scoring
    def run_scores(self, jobs: list[Job]) -> None:
        """Completions with ``max_tokens=0`` (and ``echo``): the log-probabilities of each prompt's
        tokens (:func:`~.generation.score_rows`) from its session's memory, or a fresh one. Memory is
        read, never written, and nothing is committed: scoring leaves a session as it was."""
        start = time.perf_counter()
        ok, prompts, sessions = [], [], []
        for job in jobs:
            p = job.request.prompt
            ids = self.fmt.encode_text(p) if isinstance(p, str) else list(p)
            if not ids or len(ids) > self.window:
                job.emit(
                    Failed(
                        ServeError(
                            400,
                            "the prompt is empty after tokenization"
                            if not ids
                            else f"the prompt is {len(ids)} tokens; the context window is {self.window}",
                            code=None if not ids else "context_length_exceeded",
                            param="prompt",
                        )
                    )
                )
                continue
            ok.append(job)
            prompts.append(ids)
            sessions.append(self._session(job))
        wanted = [i for i, job in enumerate(ok) if job.sampling.logprobs is not None]
        top = max((ok[i].sampling.logprobs for i in wanted), default=0)
        scores = score_rows(
            self.engine,
            self.tokenizer,
            [self._memory(sessions[i]) for i in wanted],
            [prompts[i] for i in wanted],
            [0] * len(wanted),
            top,
        )
        scored = dict(zip(wanted, scores, strict=True))
        for i, job in enumerate(ok):
            logprobs = scored.get(i)
            if logprobs is not None and job.sampling.logprobs < top:
                k = job.sampling.logprobs
                logprobs = replace(logprobs, top=[t if t is None else t[:k] for t in logprobs.top])
            answer = Answer([], "", "length", logprobs=logprobs)
            job.emit(
                Done(
                    {
                        "choices": [answer] * job.sampling.n,
                        "prompt_tokens": len(prompts[i]),
                        "written": 0,
                        "write": "none",  # scoring reads memory and writes nothing, whatever was asked
                        "tokens_written": sessions[i].tokens_written,
                        "batch": len(ok),
                        "seconds": time.perf_counter() - start,
                    }
                )
            )
