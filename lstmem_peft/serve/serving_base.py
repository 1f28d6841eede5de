"""What the serving classes share: the served model, the scheduler, request checks and replies.

:class:`ServingBase` is what every endpoint family needs (run a job on the worker, check a model
name or a session name). :class:`ServingGeneration` adds what chat and completions share: the
checks of ``max_tokens``, ``stream_options`` and sampling parameters, and one way to answer: a JSON
body, or a stream of server-sent events ending in ``data: [DONE]`` whose subclass-specific chunks
come from four small hooks (the template the two families fill in).
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from lstmem_peft.memory.sessions import SessionIdError, check_session_id

from .decoding import Sampling
from .events import Delta, Done, Event, Failed
from .jobs import Job
from .loading import LoadedModel
from .metrics import Metrics
from .protocol import MemoryUsage, ServeError, Usage
from .scheduler import Scheduler
from .vocabulary import Vocabulary

SESSION_HEADER = "X-Session-Id"


def valid_session(session: str) -> str:
    """``session`` if it is a session name the store takes; else a 400 error naming the rule."""
    try:
        return check_session_id(session)
    except SessionIdError as err:
        raise ServeError(400, str(err), code="invalid_session_id", param="session") from None


def finite(x: float | None) -> float | None:
    """JSON has no infinity: a log-probability of -inf (a token the model rules out) is -9999."""
    return x if x is None or math.isfinite(x) else -9999.0


class ServingBase:
    """The served model, its scheduler and the metrics: what every endpoint family works with.

    Args:
        loaded: the served model.
        scheduler: the worker that runs every job touching the model or a session.
        metrics: the app's metrics.
        vocabulary: what the model reads (:class:`~.vocabulary.Vocabulary`, with the request
            handlers' own tokenizer), shared by the app's serving classes; default: built on first use.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        scheduler: Scheduler,
        metrics: Metrics,
        vocabulary: Vocabulary | None = None,
    ) -> None:
        self.loaded, self.scheduler, self.metrics = loaded, scheduler, metrics
        self._vocabulary = vocabulary

    @property
    def vocabulary(self) -> Vocabulary:
        """What the model reads, and the check of the texts a request brings."""
        if self._vocabulary is None:
            self._vocabulary = Vocabulary.of(self.loaded)
        return self._vocabulary

    def check_model(self, name: str) -> None:
        """404 unless ``name`` is the served model's id."""
        if name != self.loaded.name:
            raise ServeError(
                404,
                f"the model {name!r} does not exist; this server serves {self.loaded.name!r}",
                code="model_not_found",
                param="model",
            )

    async def run(self, job: Job) -> dict:
        """Queue ``job``, wait for its result (token deltas are skipped) and return it; a job that
        failed raises its :class:`~.protocol.ServeError`."""
        self.scheduler.submit(job)
        self.metrics.queued.set(self.scheduler.queued)
        event = await job.events.get()
        while isinstance(event, Delta):
            event = await job.events.get()
        if isinstance(event, Failed):
            raise event.error
        return event.result


@dataclass
class Reply:
    """What one chat or completions response carries besides the job results.

    Attributes:
        ident: the response id (``chatcmpl-...`` or ``cmpl-...``), shared by every chunk of a stream.
        created: Unix time of the request.
        session: the request's session, or ``None``.
        n: choices per prompt.
        texts: completions: each prompt's text (for ``echo`` and the logprobs' ``text_offset``).
        echo: completions: the prompt's text opens each choice.
        include_usage: a stream ends with a chunk holding the usage.
    """

    ident: str
    created: int
    session: str | None
    n: int
    texts: list[str] | None = None
    echo: bool = False
    include_usage: bool = False


class ServingGeneration(ServingBase):
    """Chat and completions: shared request checks, sampling and answering (a body or a stream).

    A subclass sets :attr:`id_prefix`, :attr:`response_class` and :attr:`chunk_class`, and fills in
    :meth:`body` (the JSON answer's choices) and the stream's chunks: :meth:`opening_chunks`,
    :meth:`delta_chunk`, :meth:`final_chunk`.

    Args:
        loaded, scheduler, metrics, vocabulary: see :class:`ServingBase`.
        window: the context window in tokens: ``max_tokens`` must be below it.
    """

    id_prefix = ""
    #: the pydantic models of the JSON answer and of one stream chunk
    response_class: type[BaseModel]
    chunk_class: type[BaseModel]

    def __init__(
        self,
        loaded: LoadedModel,
        scheduler: Scheduler,
        metrics: Metrics,
        window: int,
        vocabulary: Vocabulary | None = None,
    ) -> None:
        super().__init__(loaded, scheduler, metrics, vocabulary)
        self.window = window

    # ------------------------------------------------------------------ request checks
    def check_max_tokens(self, max_tokens: int) -> None:
        """400 unless ``max_tokens`` leaves room for a prompt in the context window."""
        if max_tokens >= self.window:
            raise ServeError(
                400,
                f"max_tokens {max_tokens} does not fit the context window of {self.window} tokens",
                code="context_length_exceeded",
                param="max_tokens",
            )

    @staticmethod
    def check_stream_options(body) -> None:
        """``stream_options`` only goes with ``stream``."""
        if body.stream_options is not None and not body.stream:
            raise ServeError(400, "stream_options needs stream=true", param="stream_options")

    @staticmethod
    def check_write(body) -> None:
        """``lstmem_write`` ``messages_and_answer`` writes and records the turn's answer: it needs
        ``n`` 1, the one choice the conversation goes on with."""
        if body.lstmem_write == "messages_and_answer" and body.n > 1:
            raise ServeError(
                400,
                f"lstmem_write {body.lstmem_write!r} takes n=1 (got n={body.n}): the turn writes its one "
                "answer; send n=1, or lstmem_write 'messages' or 'none' for several choices",
                param="n",
                code="unsupported_parameter",
            )

    @staticmethod
    def check_version(body, session: str | None) -> None:
        """``lstmem_version`` names a version of the request's session: it needs ``X-Session-Id``."""
        if body.lstmem_version is not None and session is None:
            raise ServeError(
                400,
                f"lstmem_version {body.lstmem_version} names a version of a session, but the request has no "
                f"{SESSION_HEADER} header: send the session's id in it, or leave lstmem_version out",
                param="lstmem_version",
                code="invalid_value",
            )

    @staticmethod
    def check_stream_logprobs(logprobs: bool, stream: bool) -> None:
        """Log-probabilities come from a scoring forward after the answer: not in a stream."""
        if logprobs and stream:
            raise ServeError(
                400,
                "logprobs is not available with stream=true",
                param="logprobs",
                code="unsupported_parameter",
            )

    def check_sampling_fields(self, body, max_tokens: int) -> None:
        """``min_tokens`` at most ``max_tokens`` (vLLM's rule), and ``logit_bias`` naming token ids of
        the vocabulary."""
        if body.min_tokens > max_tokens:
            raise ServeError(
                400,
                f"min_tokens {body.min_tokens} is more than max_tokens {max_tokens}: the answer could not have "
                "that many tokens; send min_tokens <= max_tokens",
                param="min_tokens",
                code="invalid_value",
            )
        size = self.loaded.vocab_size
        outside = [token for token, _ in body.logit_biases() if token >= size]
        if outside:
            raise ServeError(
                400,
                f"logit_bias names token id {outside[0]}; the vocabulary of {self.loaded.name} has {size} "
                f"tokens, ids 0 to {size - 1}",
                param="logit_bias",
                code="invalid_value",
            )

    @staticmethod
    def sampling_of(body, max_tokens: int, logprobs: int | None, echo: bool = False) -> Sampling:
        """The decoding parameters. Greedy (``temperature`` 0, or ``top_p`` 0: a nucleus of the one
        most likely token) decoding has no seed to apply, so seeded greedy requests batch."""
        greedy = (0.0, 1.0, None)
        temperature, top_p, seed = greedy if body.greedy else (body.temperature, body.top_p, body.seed)
        return Sampling(
            max_tokens,
            temperature,
            top_p,
            body.n,
            body.stops(),
            seed,
            logprobs,
            echo,
            logit_bias=body.logit_biases(),
            min_tokens=body.min_tokens,
            ignore_eos=body.ignore_eos,
        )

    def reply(self, body, session: str | None, texts: list[str] | None = None) -> Reply:
        """A new response's id and time, and what its body or chunks need from the request."""
        return Reply(
            ident=self.id_prefix + uuid.uuid4().hex[:24],
            created=int(time.time()),
            session=session,
            n=body.n,
            texts=texts,
            echo=bool(getattr(body, "echo", False)),
            include_usage=bool(body.stream and body.stream_options and body.stream_options.include_usage),
        )

    # ------------------------------------------------------------------ answering
    async def respond(self, jobs: list[Job], reply: Reply, stream: bool) -> BaseModel | StreamingResponse:
        """Run the jobs (one per prompt, in choice order) and answer with one body; or, with
        ``stream`` (one job), start it and answer with its events once the first one arrived (so a
        request that fails before its first token gets an error status, not a broken stream)."""
        if not stream:
            results = await asyncio.gather(*(self.run(job) for job in jobs))
            for result in results:
                self.metrics.count_result(result)
            return self.body(reply, results)
        (job,) = jobs
        self.scheduler.submit(job)
        self.metrics.queued.set(self.scheduler.queued)
        first = await job.events.get()
        if isinstance(first, Failed):
            raise first.error
        return StreamingResponse(self._events(job, first, reply), media_type="text/event-stream")

    async def _events(self, job: Job, first: Event, reply: Reply) -> AsyncIterator[str]:
        """The server-sent events of a streamed job: the opening chunks, a chunk per text delta, a
        last chunk per choice (its ``finish_reason``), the usage chunk when asked for, ``[DONE]``.
        The chunk that ends the last choice carries the ``lstmem`` field. A job that fails sends an
        :class:`~.protocol.ErrorResponse` event, then ``[DONE]``. A client that goes away before the
        end cancels the job: its rows stop decoding, nothing is committed."""
        event = first
        try:
            for chunk in self.opening_chunks(reply):
                yield _sse(chunk)
            while isinstance(event, Delta):
                yield _sse(self.delta_chunk(reply, event.choice, event.text))
                event = await job.events.get()
            if isinstance(event, Failed):
                yield _sse(event.error.body())
            else:
                result = event.result
                last = len(result["choices"]) - 1
                for choice, answer in enumerate(result["choices"]):
                    chunk = self.final_chunk(reply, choice, answer.finish_reason)
                    if choice == last:  # the turn's memory report, with the version to send back
                        chunk.lstmem = memory_usage([result], reply.session)
                    yield _sse(chunk)
                self.metrics.count_result(result)
                if reply.include_usage:
                    yield _sse(self.usage_chunk(reply, usage([result])))
            yield "data: [DONE]\n\n"
        finally:
            if not isinstance(event, (Done, Failed)):
                job.cancelled.set()

    # ------------------------------------------------------------------ what a subclass fills in
    def body(self, reply: Reply, results: list[dict]) -> BaseModel:
        """The JSON answer from the jobs' results (one per prompt)."""
        raise NotImplementedError

    def opening_chunks(self, reply: Reply) -> list[BaseModel]:
        """Chunks sent before the first token."""
        raise NotImplementedError

    def delta_chunk(self, reply: Reply, choice: int, text: str) -> BaseModel:
        """The chunk that adds ``text`` to choice ``choice``."""
        raise NotImplementedError

    def final_chunk(self, reply: Reply, choice: int, finish_reason: str) -> BaseModel:
        """The chunk that ends choice ``choice``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the envelope both share
    def response(self, reply: Reply, choices: list, results: list[dict]) -> BaseModel:
        """The JSON answer around ``choices``: id, time, model, token counts and the memory's record."""
        return self.response_class(
            id=reply.ident,
            created=reply.created,
            model=self.loaded.name,
            choices=choices,
            usage=usage(results),
            lstmem=memory_usage(results, reply.session),
        )

    def _chunk(self, reply: Reply, choices: list, counts: Usage | None = None) -> BaseModel:
        return self.chunk_class(
            id=reply.ident, created=reply.created, model=self.loaded.name, choices=choices, usage=counts
        )

    def usage_chunk(self, reply: Reply, counts: Usage) -> BaseModel:
        """The chunk that carries the usage (no choices)."""
        return self._chunk(reply, [], counts)


def usage(results: list[dict]) -> Usage:
    """OpenAI's token counts over the jobs' results (every prompt and every choice)."""
    prompt = sum(r["prompt_tokens"] for r in results)
    completion = sum(len(a.token_ids) for r in results for a in r["choices"])
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def memory_usage(results: list[dict], session: str | None) -> MemoryUsage:
    """The ``lstmem`` field: the write policy applied, tokens written by the request, held by the
    session after it, batch size, the version committed, the version a turn rolled back to, and what
    the turn took in as new (a request with several prompts runs on fresh memories: its last).
    Without a session nothing is stored (the request's history goes into a fresh memory that is
    dropped with the answer): 0 tokens written, 0 held."""
    stored = session is not None
    return MemoryUsage(
        session=session,
        memory_tokens_written=sum(r["written"] for r in results) if stored else 0,
        session_tokens_written=results[-1]["tokens_written"] if stored else 0,
        batch_size=max(r["batch"] for r in results),
        write=results[0]["write"],
        version=results[-1].get("version"),
        rolled_back_to=next((r["rollback"] for r in results if r.get("rollback") is not None), None),
        new_messages=results[-1].get("new_messages"),
        new_text_from=results[-1].get("new_text_from"),
        note=results[-1].get("note"),
    )


def _sse(event: BaseModel) -> str:
    return f"data: {event.model_dump_json()}\n\n"
