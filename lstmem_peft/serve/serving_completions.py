"""``POST /v1/completions``: text turns, prompt lists, token-id prompts and scoring
(:class:`ServingCompletions`).

Each prompt is one job: a ``turn`` (the same turn as chat, on text: the part of the prompt the
session has not taken in is written by the turn rule of :mod:`.runner`, under the request's
``lstmem_write`` policy), or with ``max_tokens`` 0 and ``echo`` a ``score`` job that reads memory
and writes nothing, whatever the policy. The answer is a
:class:`~.protocol.CompletionResponse` (choice ``i * n + c`` for choice ``c`` of prompt ``i``), or
with ``stream`` (one prompt) a series of :class:`~.protocol.CompletionChunk` events.
"""

from __future__ import annotations

from fastapi.responses import StreamingResponse

from .generation import TokenLogprobs
from .jobs import CompletionTurn, Job, ScorePrompt
from .loading import LoadedModel
from .metrics import Metrics
from .protocol import (
    MAX_PROMPTS,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ServeError,
)
from .scheduler import Scheduler
from .serving_base import SESSION_HEADER, Reply, ServingGeneration, finite
from .vocabulary import Vocabulary


class ServingCompletions(ServingGeneration):
    """The completions endpoint (what lm-eval's ``local-completions`` talks to).

    Args:
        loaded, scheduler, metrics, window, vocabulary: see :class:`~.serving_base.ServingGeneration`.
    """

    response_class = CompletionResponse
    chunk_class = CompletionChunk
    id_prefix = "cmpl-"

    def __init__(
        self,
        loaded: LoadedModel,
        scheduler: Scheduler,
        metrics: Metrics,
        window: int,
        vocabulary: Vocabulary | None = None,
    ) -> None:
        super().__init__(loaded, scheduler, metrics, window, vocabulary)
        # the request handlers' own tokenizer (the worker thread uses loaded.tokenizer)
        self.tokenizer = self.vocabulary.tokenizer

    async def create(
        self, body: CompletionRequest, namespace: str, session: str | None
    ) -> CompletionResponse | StreamingResponse:
        """Check the request, run one job per prompt on ``session`` (``None``: each on a fresh
        memory, not stored) and answer."""
        self.check_model(body.model)
        self.check_stream_options(body)
        prompts = body.prompts()
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        self._check_request(body, prompts, max_tokens, session)
        self.check_sampling_fields(body, max_tokens)
        self.check_write(body)
        self.check_version(body, session)
        self.vocabulary.check_ids(prompts)  # token ids the model embeds
        self.vocabulary.check_texts(  # text it can read
            [
                (f"prompt {i}" if len(prompts) > 1 else "prompt", p)
                for i, p in enumerate(prompts)
                if isinstance(p, str)
            ],
            "prompt",
        )
        texts = [
            p if isinstance(p, str) else self.tokenizer.decode(p, skip_special_tokens=False) for p in prompts
        ]
        if body.echo and max_tokens > 0:
            self._check_echo_fits(prompts, max_tokens)
        sampling = self.sampling_of(body, max_tokens, body.logprobs, echo=body.echo)
        jobs = [
            Job(
                ScorePrompt(p)
                if max_tokens == 0
                else CompletionTurn(
                    p, display=text[-500:], write=body.lstmem_write, version=body.lstmem_version
                ),
                namespace,
                session,
                sampling=sampling,
                stream=body.stream,
            )
            for p, text in zip(prompts, texts, strict=True)
        ]
        return await self.respond(jobs, self.reply(body, session, texts), body.stream)

    # ------------------------------------------------------------------ request checks
    def _check_request(
        self, body: CompletionRequest, prompts: list, max_tokens: int, session: str | None
    ) -> None:
        """What this server takes of the OpenAI parameters, and how they combine."""
        n = body.n
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
        self.check_max_tokens(max_tokens)
        if len(prompts) > 1 and session is not None:
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
        self.check_stream_logprobs(body.logprobs is not None, body.stream)
        if max_tokens == 0 and body.lstmem_version is not None:
            raise ServeError(
                400,
                "lstmem_version names the version a turn continues; a completion that only scores its prompt "
                "(max_tokens 0) reads the session's newest version and writes nothing: leave lstmem_version out",
                param="lstmem_version",
                code="unsupported_parameter",
            )

    def _check_echo_fits(self, prompts: list, max_tokens: int) -> None:
        """With ``echo``, the echoed tokens must be the whole prompt, in context: each prompt and
        ``max_tokens`` must fit the window."""
        for i, p in enumerate(prompts):
            count = (
                len(p)
                if not isinstance(p, str)
                else len(self.tokenizer(p, add_special_tokens=False)["input_ids"])
            )
            if count + max_tokens > self.window:
                raise ServeError(
                    400,
                    f"prompt {i} is {count} tokens; with echo the whole prompt and max_tokens {max_tokens} "
                    f"must fit the context window of {self.window} tokens",
                    code="context_length_exceeded",
                    param="prompt",
                )

    # ------------------------------------------------------------------ the JSON answer
    def body(self, reply: Reply, results: list[dict]) -> CompletionResponse:
        choices = []
        for p, result in enumerate(results):
            echo = reply.texts[p] if reply.echo else ""
            for c, answer in enumerate(result["choices"]):
                logprobs = None
                if answer.logprobs is not None:  # offsets count from the choice's text: after the prompt's
                    logprobs = _logprobs(answer.logprobs, 0 if reply.echo else len(reply.texts[p]))
                choices.append(
                    CompletionChoice(
                        index=p * reply.n + c,
                        text=echo + answer.text,
                        finish_reason=answer.finish_reason,
                        logprobs=logprobs,
                    )
                )
        return self.response(reply, choices, results)

    # ------------------------------------------------------------------ the stream's chunks
    def opening_chunks(self, reply: Reply) -> list[CompletionChunk]:
        """With ``echo``, one chunk that opens every choice with the prompt's text; else none."""
        echo = reply.texts[0] if reply.echo else ""
        if not echo:
            return []
        return [self._chunk(reply, [CompletionChunkChoice(index=c, text=echo) for c in range(reply.n)])]

    def delta_chunk(self, reply: Reply, choice: int, text: str) -> CompletionChunk:
        return self._chunk(reply, [CompletionChunkChoice(index=choice, text=text)])

    def final_chunk(self, reply: Reply, choice: int, finish_reason: str) -> CompletionChunk:
        return self._chunk(reply, [CompletionChunkChoice(index=choice, text="", finish_reason=finish_reason)])


def _logprobs(lp: TokenLogprobs, offset: int) -> CompletionLogprobs:
    """OpenAI's completions form: ``tokens``, ``token_logprobs``, ``top_logprobs`` (a dict per
    token, ``None`` for a prompt's first token) and ``text_offset`` (characters into the text,
    starting at ``offset``)."""
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
            best.setdefault(x, finite(v))
        tops.append(best)
    return CompletionLogprobs(
        tokens=lp.tokens,
        token_logprobs=[finite(x) for x in lp.logprobs],
        top_logprobs=tops,
        text_offset=offsets,
    )
