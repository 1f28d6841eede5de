"""The OpenAI-compatible endpoint a build talks to: requests in flight bounded, one retry policy,
and the errors that name the endpoint."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import re

from lstmem_peft.utils.errors import UsageError
from lstmem_peft.utils.extras import missing_extra

from .config import LongDataConfig


# ---------------------------------------------------------------------- the endpoint
class EndpointError(RuntimeError):
    """The endpoint failed a request for good: a refusal that retrying cannot fix (401, 404, 400...),
    or ``max_attempts`` failures in a row. The message names the endpoint, the request and the cause."""


class BadReply(Exception):
    """A reply that arrived but cannot be used (truncated, empty, not the JSON asked for): retried."""


class Endpoint:
    """An ``openai.AsyncOpenAI`` client with a bound on requests in flight and one retry policy."""

    RETRY_STATUS = frozenset({408, 409, 425, 429})  # and every 5xx

    def __init__(self, config: LongDataConfig):
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

        ``parse`` turns the reply text into the result or raises :class:`BadReply`; ``request_id`` names
        the request in errors and goes out as the ``X-Request-Id`` header (``<id>/<attempt>``).
        """
        openai, c = self.openai, self.config
        last = "no attempt"
        for attempt in range(1, c.max_attempts + 1):
            wait = None
            try:
                async with self.slots:
                    self.requests += 1
                    reply = await self.client.chat.completions.create(
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
            except (openai.APIResponseValidationError, ValueError) as err:  # ValueError: a body not JSON
                last = f"malformed response body ({type(err).__name__}: {err})"
            else:
                try:
                    return parse(_reply_text(reply)), {"requests": attempt, **_usage(reply)}
                except BadReply as err:
                    last = str(err)
            if attempt < c.max_attempts:
                delay = min(c.max_backoff, c.backoff * 2 ** (attempt - 1)) * (0.5 + self._jitter.random() / 2)
                await asyncio.sleep(max(delay, min(wait or 0.0, c.max_backoff)))
        if "finish_reason 'length'" in last:
            fix = "Raise --max-reply-tokens, or turn the model's thinking off (--extra-body)"
        else:
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


def _reply_text(reply) -> str:
    """The message text of a chat completion, or :class:`BadReply` for anything else."""
    choices = getattr(reply, "choices", None)
    if not choices:
        raise BadReply(f"malformed response body (no choices: {str(reply)[:80]!r})")
    choice = choices[0]
    if choice.finish_reason == "length":
        raise BadReply("reply truncated at max_tokens (finish_reason 'length')")
    if choice.finish_reason not in (None, "stop", "eos"):
        raise BadReply(f"reply ended with finish_reason {choice.finish_reason!r}")
    text = getattr(choice.message, "content", None) or ""
    text = re.sub(r"^\s*<think>.*?</think>", "", text, flags=re.DOTALL)  # a thinking model's reasoning
    if not text.strip():
        raise BadReply("empty reply")
    return text.strip()


def _usage(reply) -> dict[str, int]:
    usage = getattr(reply, "usage", None)
    return {k: int(getattr(usage, k, 0) or 0) for k in ("prompt_tokens", "completion_tokens")}
