"""``POST /v1/chat/completions``: a chat turn on a session's memory (:class:`ServingChat`).

The request's messages become one ``turn`` job: the scheduler skips the messages the session took
in before, answers from memory read-only and writes what the request's ``lstmem_write`` policy says
(the new messages by default) by the turn rule (:mod:`.runner`).
The answer is a :class:`~.protocol.ChatCompletionResponse`, or with ``stream`` a series of
:class:`~.protocol.ChatCompletionChunk` events: the role, the text as it comes, ``finish_reason``.
"""

from __future__ import annotations

from fastapi.responses import StreamingResponse

from .generation import Answer
from .jobs import ChatTurn, Job
from .loading import LoadedModel
from .metrics import Metrics
from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    ServeError,
    TopLogprob,
)
from .scheduler import Scheduler
from .serving_base import Reply, ServingGeneration, finite
from .vocabulary import Vocabulary


class ServingChat(ServingGeneration):
    """The chat completions endpoint.

    Args:
        loaded, scheduler, metrics, window, vocabulary: see :class:`~.serving_base.ServingGeneration`.
        default_max_tokens: ``max_tokens`` of requests that give neither it nor ``max_completion_tokens``.
    """

    response_class = ChatCompletionResponse
    chunk_class = ChatCompletionChunk
    id_prefix = "chatcmpl-"

    def __init__(
        self,
        loaded: LoadedModel,
        scheduler: Scheduler,
        metrics: Metrics,
        window: int,
        default_max_tokens: int,
        vocabulary: Vocabulary | None = None,
    ) -> None:
        super().__init__(loaded, scheduler, metrics, window, vocabulary)
        self.default_max_tokens = default_max_tokens

    async def create(
        self, body: ChatCompletionRequest, namespace: str, session: str | None
    ) -> ChatCompletionResponse | StreamingResponse:
        """Check the request, run its turn on ``session`` (``None``: a fresh memory, not stored)
        and answer."""
        self.check_model(body.model)
        self.check_stream_options(body)
        max_tokens = body.max_completion_tokens or body.max_tokens or self.default_max_tokens
        self.check_max_tokens(max_tokens)
        self.check_sampling_fields(body, max_tokens)
        if body.top_logprobs is not None and not body.logprobs:
            raise ServeError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        self.check_stream_logprobs(bool(body.logprobs), body.stream)
        self.check_write(body)
        self.check_version(body, session)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        self.vocabulary.check_texts(
            [(f"messages[{i}].content", m["content"]) for i, m in enumerate(messages)], "messages"
        )
        job = Job(
            ChatTurn(
                messages,
                display=messages[-1]["content"],
                write=body.lstmem_write,
                version=body.lstmem_version,
            ),
            namespace,
            session,
            sampling=self.sampling_of(body, max_tokens, logprobs),
            stream=body.stream,
        )
        return await self.respond([job], self.reply(body, session), body.stream)

    # ------------------------------------------------------------------ the JSON answer
    def body(self, reply: Reply, results: list[dict]) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=i * reply.n + c,
                message=AssistantMessage(content=answer.text),
                finish_reason=answer.finish_reason,
                logprobs=None if answer.logprobs is None else _logprobs(answer),
            )
            for i, result in enumerate(results)  # one result: a chat request is one turn
            for c, answer in enumerate(result["choices"])
        ]
        return self.response(reply, choices, results)

    # ------------------------------------------------------------------ the stream's chunks
    def opening_chunks(self, reply: Reply) -> list[ChatCompletionChunk]:
        """One chunk that opens every choice's message: ``{"role": "assistant", "content": ""}``."""
        opening = ChatDelta(role="assistant", content="")
        return [self._chunk(reply, [ChatChunkChoice(index=c, delta=opening) for c in range(reply.n)])]

    def delta_chunk(self, reply: Reply, choice: int, text: str) -> ChatCompletionChunk:
        return self._chunk(reply, [ChatChunkChoice(index=choice, delta=ChatDelta(content=text))])

    def final_chunk(self, reply: Reply, choice: int, finish_reason: str) -> ChatCompletionChunk:
        ending = ChatChunkChoice(index=choice, delta=ChatDelta(), finish_reason=finish_reason)
        return self._chunk(reply, [ending])


def _logprobs(answer: Answer) -> ChatLogprobs:
    """OpenAI's chat form: one entry per answer token (the EOS that ended it is not one)."""
    lp = answer.logprobs
    content = []
    for t in range(len(answer.token_ids)):
        top = [TopLogprob(token=x, logprob=finite(v), bytes=list(x.encode())) for x, v in lp.top[t]]
        token = lp.tokens[t]
        content.append(
            ChatTokenLogprob(
                token=token, logprob=finite(lp.logprobs[t]), bytes=list(token.encode()), top_logprobs=top
            )
        )
    return ChatLogprobs(content=content)
