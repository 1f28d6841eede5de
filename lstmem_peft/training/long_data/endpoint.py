"""The OpenAI-compatible endpoint a build talks to: requests in flight bounded, one retry policy,
and the errors that name the endpoint."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import random
import re
from collections.abc import Callable

from lstmem_peft.utils.errors import UsageError, describe
from lstmem_peft.utils.extras import missing_extra

from .config import LongDataConfig


# ---------------------------------------------------------------------- the endpoint
class EndpointError(RuntimeError):
    """The endpoint failed a request for good: a refusal that retrying cannot fix (401, 404, 400...),
    or ``max_attempts`` failures in a row. The message names the endpoint, the request and the cause."""


log = logging.getLogger("lstmem.data")

#: The fix when replies are not chat completions at all (an HTML page, another API's JSON).
NOT_CHAT = (
    "Check that --base-url is the API root (.../v1) of an OpenAI-compatible chat-completions server and "
    "that it serves --model"
)


class BadReply(Exception):
    """A reply that arrived but cannot be used (not a chat completion, truncated, empty, not the JSON
    asked for): retried. ``str(err)`` says what is wrong; ``fix``, when set, what to do if it persists."""

    def __init__(self, reason: str, fix: str | None = None):
        super().__init__(reason)
        self.fix = fix


class Endpoint:
    """An ``openai.AsyncOpenAI`` client with a bound on requests in flight and one retry policy."""

    RETRY_STATUS = frozenset({408, 409, 425, 429})  # and every 5xx

    def __init__(self, config: LongDataConfig, on_first_reply: Callable[[], None] | None = None):
        try:
            import openai
        except ModuleNotFoundError as err:
            raise missing_extra(err, "data", "Building the Long dataset (lstmem data long)") from err
        key = os.environ.get(config.api_key_env)
        if key is None and config.api_key_env != LongDataConfig.api_key_env:
            raise UsageError(f"environment variable {config.api_key_env} (named by --api-key-env) is not set")
        self.openai, self.config = openai, config
        self.client = openai.AsyncOpenAI(
            base_url=config.base_url, api_key=key or "EMPTY", max_retries=0, timeout=config.timeout
        )
        self.slots = asyncio.Semaphore(config.concurrency)
        self.requests = 0
        self.on_first_reply = on_first_reply  # called once, at the first usable reply
        self._jitter = random.Random()

    def _fail(self, request_id: str, what: str, fix: str) -> EndpointError:
        c = self.config
        return EndpointError(f"{c.base_url} (model {c.model!r}), request {request_id}: {what}. {fix}")

    def _refusal(self, err, request_id: str) -> EndpointError:
        status, c = err.status_code, self.config
        fixes = {
            401: f"Put the endpoint's API key in the environment variable {c.api_key_env} (or name another "
            "with --api-key-env)",
            403: f"The key in {c.api_key_env} may not use this model",
            404: f"Check --base-url (vLLM and lstmem serve answer under .../v1) and --model ({c.base_url}/models "
            "lists the served names)",
        }
        other = "If it says the prompt is too long for the model, lower --chunk-tokens or --tail-chars"
        fix = fixes.get(status, other)
        return self._fail(request_id, f"refused with HTTP {status} ({_message(err)})", fix)

    async def chat(self, messages, *, request_id: str, max_tokens: int, parse, json_mode: bool = False):
        """``(parse(reply text), usage)`` of one chat completion, retried as the class says; ``usage``
        counts the attempts (``requests``) and the reply's ``prompt_tokens`` and ``completion_tokens``.

        The reply body is read as JSON and checked field by field (:func:`reply_text`): whatever its
        shape, it is either used or retried as an unusable reply. ``parse`` turns the reply text into
        the result or raises :class:`BadReply`; ``request_id`` names the request in errors and the log
        and goes out as the ``X-Request-Id`` header (``<id>/<attempt>``). Each failed attempt that is
        retried is logged (logger ``lstmem.data``, WARNING) with the endpoint and the reason.
        """
        openai, c = self.openai, self.config
        last, fix = "no attempt", None
        for attempt in range(1, c.max_attempts + 1):
            wait, fix = None, None
            try:
                async with self.slots:
                    self.requests += 1
                    raw = await self.client.chat.completions.with_raw_response.create(
                        model=c.model,
                        messages=messages,
                        max_tokens=max_tokens,
                        temperature=c.temperature,
                        seed=_request_seed(c.seed, request_id, attempt),
                        extra_headers={"X-Request-Id": f"{request_id}/{attempt}"},
                        extra_body=c.extra_body,
                        **({"response_format": {"type": "json_object"}} if json_mode else {}),
                    )
            except openai.APITimeoutError:
                last = f"no reply within {c.timeout:g} s"
            except openai.APIConnectionError as err:
                last = f"connection failed ({err.__cause__ or err})"
            except openai.APIStatusError as err:
                if err.status_code < 500 and err.status_code not in self.RETRY_STATUS:
                    raise self._refusal(err, request_id) from err
                last = f"HTTP {err.status_code} ({_message(err)})"
                wait = _retry_after(err.response)
            except (openai.APIResponseValidationError, ValueError) as err:  # the client's own checks
                last, fix = f"unusable reply: malformed response ({type(err).__name__}: {err})", NOT_CHAT
            else:
                try:
                    body = reply_body(raw.content, raw.headers.get("content-type"))
                    result = parse(reply_text(body))
                except BadReply as err:
                    last, fix = f"unusable reply: {err}", err.fix
                else:
                    if self.on_first_reply is not None:
                        first, self.on_first_reply = self.on_first_reply, None
                        first()
                    return result, {"requests": attempt, **reply_usage(body)}
            if attempt < c.max_attempts:
                delay = min(c.max_backoff, c.backoff * 2 ** (attempt - 1)) * (0.5 + self._jitter.random() / 2)
                delay = max(delay, min(wait or 0.0, c.max_backoff))
                log.warning(
                    "%s (model %r), request %s, attempt %d of %d: %s; retrying in %.2g s",
                    c.base_url, c.model, request_id, attempt, c.max_attempts, last, delay,
                )  # fmt: skip
                await asyncio.sleep(delay)
        if "finish_reason 'length'" in last:
            fix = "Raise --max-reply-tokens, or turn the model's thinking off (--extra-body)"
        elif fix is None:
            fix = (
                "Check that the server is up and serves this model; raise --max-attempts or --timeout if slow"
            )
        fix += ". Then rerun the same command: finished candidates are kept"
        raise self._fail(request_id, f"failed {c.max_attempts} times in a row; last: {last}", fix)

    async def close(self) -> None:
        await self.client.close()


def _request_seed(seed: int, request_id: str, attempt: int) -> int:
    digest = hashlib.sha256(f"{seed}/{request_id}/{attempt}".encode()).digest()
    return int.from_bytes(digest[:4], "big") >> 1  # 31 bits: every server takes it


def _message(err) -> str:
    body = err.body if isinstance(getattr(err, "body", None), dict) else {}
    text = body.get("message") or getattr(err, "message", "") or ""
    return " ".join(str(text).split())[:200]


def _retry_after(response) -> float | None:
    try:
        return float(response.headers.get("retry-after"))
    except (TypeError, ValueError, AttributeError):
        return None


# ---------------------------------------------------------------------- reading a reply
def reply_body(data: bytes, content_type: str | None = None) -> dict:
    """The JSON object of a reply body, or :class:`BadReply` saying what came instead (an HTML page,
    a body cut short, a JSON list, an error object sent with HTTP 200)."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):  # ValueError: not JSON, or not UTF-8
        kind = (content_type or "no Content-Type").split(";")[0].strip()
        raise BadReply(
            f"the body is not JSON ({kind}, {len(data)} bytes: {_snippet(data)})", NOT_CHAT
        ) from None
    if not isinstance(body, dict):
        raise BadReply(f"the body is {describe(body)}, expected a JSON object (a chat completion)", NOT_CHAT)
    if "error" in body and "choices" not in body:
        error = body["error"]
        text = error.get("message", error) if isinstance(error, dict) else error
        raise BadReply(f"the endpoint sent an error with HTTP 200: {' '.join(str(text).split())[:200]}")
    return body


def reply_text(body: dict) -> str:
    """The message text of a chat-completion body (``choices[0].message.content``, a thinking model's
    leading ``<think>...</think>`` removed), or :class:`BadReply` naming the field that is wrong."""
    if "choices" not in body:
        raise BadReply(f"no 'choices' in the reply, which is {describe(body)}", NOT_CHAT)
    choices = body["choices"]
    if not isinstance(choices, list):
        raise BadReply(f"choices is {describe(choices)}, expected a list of objects", NOT_CHAT)
    if not choices:
        raise BadReply("choices is an empty list", NOT_CHAT)
    choice = choices[0]
    if not isinstance(choice, dict):
        raise BadReply(f"choices[0] is {describe(choice)}, expected an object", NOT_CHAT)
    finish = choice.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        raise BadReply(f"choices[0].finish_reason is {describe(finish)}, expected a string or null", NOT_CHAT)
    if finish == "length":
        raise BadReply("reply truncated at max_tokens (finish_reason 'length')")
    if finish not in (None, "stop", "eos"):
        raise BadReply(f"reply ended with finish_reason {finish!r}")
    message = choice.get("message")
    if not isinstance(message, dict):
        got = "no message" if message is None else f"a message that is {describe(message)}"
        raise BadReply(f"choices[0] has {got}, expected an object with the reply's content", NOT_CHAT)
    text = _content(message)
    text = re.sub(r"^\s*<think>.*?</think>", "", text, flags=re.DOTALL)  # a thinking model's reasoning
    if not text.strip():
        raise BadReply("empty reply")
    return text.strip()


def _content(message: dict) -> str:
    """``message.content`` as text: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if content is None:
        refusal = message.get("refusal")
        if isinstance(refusal, str) and refusal.strip():
            raise BadReply(f"the model refused: {' '.join(refusal.split())[:200]!r}")
        thought = any(message.get(k) for k in ("reasoning_content", "reasoning"))
        raise BadReply(
            "empty reply (content is null" + ("; the reply holds only reasoning)" if thought else ")"),
            "Turn the model's thinking off (--extra-body) or raise --max-reply-tokens" if thought else None,
        )
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise BadReply(
                    f"choices[0].message.content[{k}] is {describe(part)}, expected a text part "
                    '{"type": "text", "text": "..."}',
                    NOT_CHAT,
                )
            parts.append(part["text"])
        return "".join(parts)
    raise BadReply(f"choices[0].message.content is {describe(content)}, expected a string", NOT_CHAT)


def reply_usage(body: dict) -> dict[str, int]:
    """The reply's ``prompt_tokens`` and ``completion_tokens`` (0 where missing or not a count)."""
    usage = body.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    return {
        k: v if isinstance(v := usage.get(k), int) and not isinstance(v, bool) and v >= 0 else 0
        for k in ("prompt_tokens", "completion_tokens")
    }


def _snippet(data: bytes) -> str:
    text = " ".join(data[:200].decode("utf-8", "replace").split())
    return repr(text[:80] + ("..." if len(text) > 80 or len(data) > 200 else "")) if text else "empty"
