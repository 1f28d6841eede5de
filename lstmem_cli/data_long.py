"""The options of ``lstmem data long`` (the stage-2 Long dataset): one per field of
:class:`lstmem_peft.training.long_data.LongDataConfig` (its ``dest`` the field's name), beside the
run's own switches. They are written here, not read from the config, so that ``lstmem data long
--help`` imports nothing of the library; tests/test_long_data.py checks that each option's help,
default and rule names are the config's."""

from __future__ import annotations

import argparse
import json

#: The rules of :mod:`lstmem_peft.training.long_data.rules`, in their order there (``--skip-rule``).
RULE_NAMES = (
    "context_below_target",
    "context_over_cap",
    "email_outside_example_domains",
    "role_marker",
    "assistant_chatter",
    "question_reveals_answer",
    "answer_length",
    "answer_not_in_context",
    "question_refers_to_passage",
    "duplicate_question",
    "too_few_questions",
)


def positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def topics_file(path: str) -> tuple[str, ...]:
    """argparse type: the topics of a text file, one per line."""
    try:
        with open(path, encoding="utf-8") as fh:
            topics = tuple(line.strip() for line in fh if line.strip())
    except OSError as err:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {err.strerror}") from None
    if not topics:
        raise argparse.ArgumentTypeError(f"{path} holds no topic (expected one topic per line)")
    return topics


def json_object(text: str) -> dict:
    """argparse type: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


#: (option, config field, default, argparse keywords, help without the default). ``default`` None:
#: none shown; the config's defaults are the ones that apply (absent options are not passed to it).
OPTIONS: tuple[tuple[str, str, object, dict, str], ...] = (
    ("--model", "model", None, {"required": True, "metavar": "NAME"},
     "model name the endpoint serves (GET <base-url>/models)"),
    ("--tokenizer", "tokenizer", None, {"required": True, "metavar": "NAME_OR_DIR"},
     "the TARGET model's tokenizer (Hub id or folder): every token count uses it"),
    ("--base-url", "base_url", "http://127.0.0.1:8000/v1", {"metavar": "URL"}, "OpenAI-compatible API root"),
    ("--api-key-env", "api_key_env", "OPENAI_API_KEY", {"metavar": "NAME"},
     "environment variable holding the API key; unset: none is sent"),
    ("--candidates", "num_candidates", 100, {"type": positive, "metavar": "N"}, "candidate contexts to generate"),
    ("--seed", "seed", 42, {"type": int, "metavar": "N"},
     "candidate ids, topics, targets and request seeds derive from it"),
    ("--target-tokens", "target_tokens", (32768, 65536), {"type": positive, "nargs": "+", "metavar": "N"},
     "context targets; candidate i gets the (i mod n)-th"),
    ("--chunk-tokens", "chunk_tokens", 4096, {"type": positive, "metavar": "N"}, "size asked of each chunk request"),
    ("--questions-per-chunk", "questions_per_chunk", 1, {"type": positive, "metavar": "N"},
     "questions asked about each generated chunk"),
    ("--answer-tokens", "answer_tokens", (6, 15), {"type": positive, "nargs": 2, "metavar": ("MIN", "MAX")},
     "answer length range, in target tokens"),
    ("--temperature", "temperature", 0.8, {"type": float, "metavar": "X"}, "sampling temperature"),
    ("--topics", "topics", "the built-in list", {"type": topics_file, "metavar": "FILE"},
     "document topics (option: a file, one per line)"),
    ("--tail-chars", "tail_chars", 4000, {"type": positive, "metavar": "N"},
     "characters of the text so far that each chunk request shows"),
    ("--max-reply-tokens", "max_reply_tokens", None, {"type": positive, "metavar": "N"},
     "max_tokens of chunk requests (default: 2x chunk tokens)"),
    ("--extra-body", "extra_body", None, {"type": json_object, "metavar": "JSON"},
     'JSON added to every request, e.g. {"chat_template_kwargs": {"enable_thinking": false}}'),
    ("--json-mode", "json_mode", None, {"action": "store_true"},
     "ask question replies in JSON mode (response_format; vLLM has it)"),
    ("--concurrency", "concurrency", 8, {"type": positive, "metavar": "N"}, "requests in flight at most"),
    ("--max-attempts", "max_attempts", 6, {"type": positive, "metavar": "N"}, "attempts per request before giving up"),
    ("--timeout", "timeout", 600.0, {"type": float, "metavar": "X"}, "seconds to wait for one reply"),
    ("--backoff", "backoff", 1.0, {"type": float, "metavar": "X"},
     "first retry delay in seconds, doubled per retry (with jitter)"),
    ("--max-backoff", "max_backoff", 60.0, {"type": float, "metavar": "X"}, "longest retry delay in seconds"),
    ("--min-questions", "min_questions", 1, {"type": positive, "metavar": "N"},
     "fewest questions an accepted context has"),
    ("--drop-bad-questions", "drop_bad_questions", None, {"action": "store_true"},
     "drop failing questions instead of rejecting the context"),
    ("--skip-rule", "skip_rules", None, {"action": "append", "choices": RULE_NAMES, "metavar": "RULE"},
     f"a rule to turn off (repeatable): {', '.join(RULE_NAMES)}"),
    ("--allow-email-domain", "email_domains", None, {"action": "append", "metavar": "DOMAIN"},
     "an e-mail domain to allow besides the example domains (repeatable)"),
)  # fmt: skip


def shown(default) -> str:
    """A default as the help shows it: a sequence's items apart."""
    return " ".join(map(str, default)) if isinstance(default, tuple) else str(default)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``lstmem data long``: ``--out`` and the run's switches, then :data:`OPTIONS`
    (an option left out is absent from the parsed arguments, so the config's default applies)."""
    p = parser.add_argument
    p("--debug", action="store_true", help="show the full traceback of an error")
    p("--out", required=True, metavar="DIR", help="output folder; rerunning into it resumes the build")
    p("--push-to-hub", default=None, metavar="REPO_ID", help="then upload the folder as a Hub dataset")
    p("--private", action="store_true", help="with --push-to-hub: create the repository private")
    p("--no-progress", action="store_true", help="no progress bar")
    for option, dest, default, keywords, help in OPTIONS:
        text = help if default is None else f"{help} (default: {shown(default)})"
        p(option, dest=dest, default=argparse.SUPPRESS, help=text, **keywords)
