"""``lstmem data long``: build the paper's stage-2 Long dataset through an OpenAI-compatible endpoint.

The paper (App. C.4, "Long dataset") generates 100 candidate contexts chunk by chunk through an API,
to targets of about 32K and 64K tokens under the trained model's tokenizer, pairs each with questions
whose answers hold 6 to 15 tokens, and rejects 29 candidates by automatic checks. This module does
the same through any chat-completions endpoint (vLLM, ``lstmem serve``, a hosted API)::

    config = LongDataConfig(base_url="http://127.0.0.1:8000/v1", model="Qwen/Qwen3-32B",
                            tokenizer="Qwen/Qwen3-4B")
    result = build_long_dataset(config, "long-data")          # resumes what is already there
    episodes = load_episodes("long-data", "long_qa")           # one episode per question
    push_to_hub("long-data", "user/lstmem-long")               # a Hub *dataset*

Per candidate ``i`` (id ``s<seed>-c<i:05d>``): a topic and a token target drawn from the seed; chunks
requested one after another, each continuing from the tail of the text so far, until the context
holds ``target_tokens`` under the *target* tokenizer; then one question request per chunk. The
finished candidate and its rule verdict are appended to ``candidates.jsonl`` (fsynced), so a rerun
with the same settings skips it; a half-written last line (a crash) is dropped and that candidate
generated again. At the end the rules (:mod:`.rules`) judge every candidate with the
current rule settings and the folder gets::

    build.json        the generation settings, recorded at the endpoint's first usable reply (once a
                      candidate is finished, a rerun with other settings is refused); see .journal
    candidates.jsonl  the journal: every finished candidate, accepted or not, with its verdict
    train.jsonl       accepted records {"id", "topic", "target_tokens", "context_tokens", "context",
                      "qas": [{"question", "answer", "answer_tokens", "chunk"}]}: load_episodes' long_qa
    report.json       counts per rule, every rejected candidate with its findings, token statistics
    README.md         the dataset card (YAML header, settings, counts, statistics, rule report)

Requests go through the ``openai`` client (the ``data`` extra) with at most ``concurrency`` in
flight; timeouts, connection errors, HTTP 408/409/429/5xx, truncated replies
(``finish_reason == "length"``) and unusable replies (a body that is not JSON or not a chat
completion, content that is not text: :func:`.endpoint.reply_text` checks each field) are retried
with exponential backoff and jitter, at most ``max_attempts`` times, each retry logged (logger
``lstmem.data``) with the endpoint and the reason; then :class:`EndpointError` names the endpoint
and the last failure. The API key comes from an environment variable (``api_key_env``), never from an argument.
"""

from .build import (
    BuildResult,
    build_long_dataset,
    config_from_args,
    push_to_hub,
    run,
    write_outputs,
)
from .config import LongDataConfig, candidate_id, load_tokenizer
from .endpoint import Endpoint, EndpointError

__all__ = [
    "BuildResult",
    "Endpoint",
    "EndpointError",
    "LongDataConfig",
    "build_long_dataset",
    "candidate_id",
    "config_from_args",
    "load_tokenizer",
    "push_to_hub",
    "run",
    "write_outputs",
]
