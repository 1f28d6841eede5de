"""The settings of a Long-dataset build and what follows from them alone: each candidate's id,
topic and token target, and the target model's tokenizer."""

from __future__ import annotations

import json
import random
from dataclasses import MISSING, dataclass, field

from lstmem_peft.utils.errors import MissingDataError, UsageError

from .rules import (
    RULES,
    RuleSettings,
    check_rule_names,
)

FORMAT = "lstmem-long-data/1"
SETTINGS, JOURNAL, DATA, REPORT, CARD = (
    "build.json",
    "candidates.jsonl",
    "train.jsonl",
    "report.json",
    "README.md",
)
PUBLISHED = (DATA, REPORT, CARD)  # what push_to_hub uploads (not the journal: it holds rejected text)
WORDS_PER_TOKEN = 0.75  # to phrase token targets as word counts in prompts; the rules count real tokens

TOPICS = (
    "the minutes of a year of weekly meetings of a small town's harbour committee",
    "the field notebook of a botanist surveying an island over one season",
    "an e-mail archive of a team building a regional weather-alert app",
    "the case file of a detective agency investigating a string of thefts from a museum",
    "the logbook of a research ship on a long expedition",
    "the letters between two siblings who run bakeries in different cities",
    "the project diary of an engineer restoring an old railway bridge",
    "the chronicle of a fictional mountain village over three generations",
    "the support tickets of a company that rents out electric boats",
    "the travel journal of a musician touring small concert halls",
    "the lab notebook of a team developing a new kind of glue",
    "the records of a community garden: plots, members, harvests and disputes",
    "the planning documents of a festival organised by a university club",
    "the memoir of a retired air-traffic controller",
    "the newsletter archive of a neighbourhood chess club",
    "the inventory and correspondence of a family-run hardware shop",
    "the court transcripts of a small-claims dispute between two landlords",
    "the mission reports of a volunteer mountain-rescue team",
)
SEED_WORDS = (
    "lantern", "ferry", "copper", "orchard", "violin", "glacier", "ledger", "kite", "quarry", "compass",
    "beehive", "telescope", "canal", "saffron", "typewriter", "lighthouse", "marble", "windmill",
    "parcel", "greenhouse", "tram", "anchor", "ink", "sawmill", "harp", "cellar", "falcon", "tapestry",
)  # fmt: skip
WRITER_SYSTEM = (
    "You write long, detailed fictional documents for a reading-comprehension data set. Write only the "
    "document itself: no notes to the reader, no questions, no code fences. Fill it with concrete details a "
    "reader could later be asked about: names, dates, times, places, quantities, codes, decisions and why they "
    "were taken. Keep every detail consistent with what came before. Never write speaker labels such as "
    "'User:' or 'Assistant:'. Every e-mail address must be at example.com, example.org or example.net."
)
QA_SYSTEM = "You write reading-comprehension questions. Reply with one JSON object and nothing else."


# ---------------------------------------------------------------------- settings
def _setting(help: str, default=MISSING):
    """A config field and what it does (``help``: also the help of its ``lstmem data long`` option,
    lstmem_cli/data_long.py)."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class LongDataConfig:
    """Settings of a Long-dataset build; each field's ``help`` says what it does (it is also the help
    of its ``lstmem data long`` option, ``--<field-name>`` unless named otherwise: the command's front
    writes the options out, lstmem_cli/data_long.py, and tests/test_long_data.py keeps them equal).

    The :attr:`GENERATION` settings shape what is generated: a rerun into the same folder must keep
    them (``build.json`` records them). The others (endpoint, transport, candidate count and the rule
    settings) may change between runs: the rules judge every candidate again at the end.
    """

    model: str = _setting("model name the endpoint serves (GET <base-url>/models)")
    tokenizer: str = _setting("the TARGET model's tokenizer (Hub id or folder): every token count uses it")
    base_url: str = _setting("OpenAI-compatible API root", "http://127.0.0.1:8000/v1")
    api_key_env: str = _setting(
        "environment variable holding the API key; unset: none is sent", "OPENAI_API_KEY"
    )
    num_candidates: int = _setting("candidate contexts to generate", 100)
    seed: int = _setting("candidate ids, topics, targets and request seeds derive from it", 42)
    target_tokens: tuple[int, ...] = _setting(
        "context targets; candidate i gets the (i mod n)-th", (32768, 65536)
    )
    chunk_tokens: int = _setting("size asked of each chunk request", 4096)
    questions_per_chunk: int = _setting("questions asked about each generated chunk", 1)
    answer_tokens: tuple[int, int] = _setting("answer length range, in target tokens", (6, 15))
    temperature: float = _setting("sampling temperature", 0.8)
    topics: tuple[str, ...] = _setting("document topics (option: a file, one per line)", TOPICS)
    tail_chars: int = _setting("characters of the text so far that each chunk request shows", 4000)
    max_reply_tokens: int | None = _setting("max_tokens of chunk requests (default: 2x chunk tokens)", None)
    extra_body: dict | None = _setting(
        'JSON added to every request, e.g. {"chat_template_kwargs": {"enable_thinking": false}}', None
    )
    json_mode: bool = _setting("ask question replies in JSON mode (response_format; vLLM has it)", False)
    concurrency: int = _setting("requests in flight at most", 8)
    max_attempts: int = _setting("attempts per request before giving up", 6)
    timeout: float = _setting("seconds to wait for one reply", 600.0)
    backoff: float = _setting("first retry delay in seconds, doubled per retry (with jitter)", 1.0)
    max_backoff: float = _setting("longest retry delay in seconds", 60.0)
    min_questions: int = _setting("fewest questions an accepted context has", 1)
    drop_bad_questions: bool = _setting("drop failing questions instead of rejecting the context", False)
    skip_rules: tuple[str, ...] = _setting(f"a rule to turn off (repeatable): {', '.join(RULES)}", ())
    email_domains: tuple[str, ...] = _setting(
        "an e-mail domain to allow besides the example domains (repeatable)", ()
    )

    GENERATION = (
        "model", "tokenizer", "seed", "target_tokens", "chunk_tokens", "questions_per_chunk", "answer_tokens",
        "temperature", "topics", "tail_chars", "max_reply_tokens", "extra_body", "json_mode",
    )  # fmt: skip

    def __post_init__(self):
        for name in ("num_candidates", "chunk_tokens", "questions_per_chunk", "tail_chars", "concurrency"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_attempts < 1 or self.timeout <= 0 or self.backoff < 0 or self.max_backoff < self.backoff:
            raise UsageError("need max_attempts >= 1, timeout > 0 and 0 <= backoff <= max_backoff")
        if not self.target_tokens or min(self.target_tokens) < 1:
            raise UsageError(f"target_tokens needs positive token counts, got {self.target_tokens}")
        if not self.topics or not all(t.strip() for t in self.topics):
            raise UsageError("topics must be a non-empty list of non-blank descriptions")
        if self.temperature < 0:
            raise UsageError(f"temperature must be >= 0, got {self.temperature}")
        try:
            self.rule_settings()
            check_rule_names(self.skip_rules)
        except ValueError as err:
            raise UsageError(str(err)) from None

    def rule_settings(self) -> RuleSettings:
        return RuleSettings(
            min_answer_tokens=self.answer_tokens[0],
            max_answer_tokens=self.answer_tokens[1],
            min_questions=self.min_questions,
            email_domains=tuple(self.email_domains),
        )

    def generation(self) -> dict:
        """The settings that shape what is generated, as JSON values (``build.json``)."""
        return json.loads(json.dumps({name: getattr(self, name) for name in self.GENERATION}))


def candidate_id(seed: int, index: int) -> str:
    """The deterministic id of candidate ``index`` of a build with ``seed``."""
    return f"s{seed}-c{index:05d}"


def _rng(*parts) -> random.Random:
    return random.Random("/".join(map(str, ("lstmem-long", *parts))))  # str seeds hash stably (sha512)


def plan(config: LongDataConfig, index: int) -> tuple[str, int, list[str]]:
    """``(topic, target tokens, seed words)`` of candidate ``index``."""
    rng = _rng(config.seed, index)
    topic = rng.choice(config.topics)
    return topic, config.target_tokens[index % len(config.target_tokens)], rng.sample(SEED_WORDS, 3)


def load_tokenizer(name: str):
    """The target tokenizer (``AutoTokenizer``): from the Hub cache or a folder first, downloading
    only when it is not there (``HF_HUB_OFFLINE=1`` forbids that)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError):
        pass
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as err:
        raise MissingDataError(
            name,
            "the target model's tokenizer (a Hub id or a folder with tokenizer files)",
            str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__,
            "Pass --tokenizer with the model the dataset will train, e.g. Qwen/Qwen3-4B",
        ) from err


def count_tokens(tokenizer, text: str) -> int:
    """Tokens of ``text`` under ``tokenizer``, without special tokens (as the trainer writes a history)."""
    return len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
