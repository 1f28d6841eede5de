"""The Long dataset's automatic checks (paper App. C.4) as named rules, and the build's report and card.

The paper generates 100 candidate contexts and rejects 29 of them, "for example because they contain
email addresses outside example domains, leak conversation-role markers, or include a question that
reveals its answer". Each check here is a :class:`Rule`: a name, the reason it exists, and a small
function that reads one :class:`Candidate` and yields what it found. :func:`judge` runs them all and
returns a :class:`Verdict`. The report side: :func:`rule_report` sums verdicts per rule,
:func:`dataset_report` adds counts and token statistics (``report.json``), :func:`report_table` prints
the rules' part and :func:`dataset_card` renders the whole as the dataset's README.md.

A finding names the question it concerns, or none when it concerns the context. By default any
finding rejects the whole candidate, as in the paper; with ``drop_bad_questions`` a question-level
finding drops only that question, and the candidate is rejected for context-level findings (or
when fewer than ``min_questions`` questions are left).

Token counts are measured with the *target* model's tokenizer before the rules run (the candidate
carries them), so this module needs no tokenizer.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from lstmem_peft.memory import constants as K


@dataclass(frozen=True)
class QA:
    """One question and its answer; ``answer_tokens`` counts ``" " + answer`` under the target
    tokenizer (what the trainer supervises, without EOS); ``chunk`` is the generated chunk it is about."""

    question: str
    answer: str
    answer_tokens: int
    chunk: int = 0


@dataclass(frozen=True)
class Candidate:
    """What the rules read: one generated context and its questions.

    Attributes:
        id: the deterministic candidate id (``s<seed>-c<index>``).
        context: the history, the generated chunks joined by blank lines.
        qas: the questions, in generation order.
        context_tokens: ``len(tokenizer(context))`` under the target tokenizer (no special tokens).
        target_tokens: the length the context was generated to reach.
        chunk_starts: the character offset in ``context`` where each generated chunk begins.
    """

    id: str
    context: str
    qas: tuple[QA, ...]
    context_tokens: int
    target_tokens: int
    chunk_starts: tuple[int, ...] = (0,)

    def chunks(self) -> list[str]:
        """The generated chunks, as the endpoint returned them (whitespace stripped)."""
        ends = [*self.chunk_starts[1:], len(self.context)]
        return [self.context[a:b].strip() for a, b in zip(self.chunk_starts, ends, strict=True)]


@dataclass(frozen=True)
class RuleSettings:
    """Thresholds of the rules.

    Attributes:
        min_answer_tokens, max_answer_tokens: the answer length range in target tokens (paper: 6-15).
        min_questions: fewest questions a kept context may have.
        max_context_tokens: longest context the trainer writes whole (the stage-2 cap, 131,072).
        min_answer_overlap: share of an answer's words that must occur in the context.
        email_domains: domains allowed besides the reserved example domains (RFC 2606), with their
            subdomains.
    """

    min_answer_tokens: int = 6
    max_answer_tokens: int = 15
    min_questions: int = 1
    max_context_tokens: int = K.STAGE2_HISTORY_CAP
    min_answer_overlap: float = 0.5
    email_domains: tuple[str, ...] = ()

    def __post_init__(self):
        if not 1 <= self.min_answer_tokens <= self.max_answer_tokens:
            raise ValueError(
                f"answer token range {self.min_answer_tokens}-{self.max_answer_tokens} is empty; "
                "pass 1 <= min <= max (the paper uses 6-15)"
            )
        if not 0.0 <= self.min_answer_overlap <= 1.0:
            raise ValueError(f"min_answer_overlap must lie in [0, 1], got {self.min_answer_overlap}")


@dataclass(frozen=True)
class Finding:
    """One problem: the rule that found it, what it found, and the question (index into the
    candidate's ``qas``) it concerns, or ``None`` for the context."""

    rule: str
    detail: str
    question: int | None = None

    def to_json(self) -> dict:
        return {"rule": self.rule, "detail": self.detail, "question": self.question}


Check = Callable[[Candidate, RuleSettings], Iterator[tuple[int | None, str]]]


@dataclass(frozen=True)
class Rule:
    """A named check: ``check(candidate, settings)`` yields ``(question index or None, detail)``."""

    name: str
    reason: str
    check: Check = field(repr=False)

    def __call__(self, candidate: Candidate, settings: RuleSettings) -> list[Finding]:
        return [Finding(self.name, detail, q) for q, detail in self.check(candidate, settings)]


#: Every rule, by name, in the order the report lists them.
RULES: dict[str, Rule] = {}


def rule(name: str, reason: str) -> Callable[[Check], Check]:
    """Register ``check`` in :data:`RULES` under ``name``."""

    def register(check: Check) -> Check:
        RULES[name] = Rule(name, reason, check)
        return check

    return register


# ---------------------------------------------------------------------- text helpers
def normal(text: str) -> str:
    """Casefolded words separated by single spaces (punctuation dropped), for comparisons."""
    return " ".join(re.findall(r"\w+", text.casefold()))


def _short(text: str, limit: int = 60) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@([A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9-]+)+)")
#: RFC 2606: reserved second-level domains, and reserved top-level domains.
EXAMPLE_DOMAINS = ("example.com", "example.org", "example.net")
RESERVED_TLDS = ("example", "test", "invalid", "localhost")


def email_allowed(domain: str, extra: Sequence[str] = ()) -> bool:
    """Whether an e-mail domain is reserved for examples (RFC 2606) or in ``extra`` (or a subdomain)."""
    domain = domain.lower().rstrip(".")
    if domain.rpartition(".")[2] in RESERVED_TLDS:
        return True
    return any(domain == d or domain.endswith("." + d) for d in (*EXAMPLE_DOMAINS, *map(str.lower, extra)))


# Speaker labels of a chat transcript at the start of a line (optionally in markdown bold), and the
# special tokens of common chat templates (ChatML, Llama 2/3, Gemma, Qwen3 thinking) anywhere.
ROLE_LABEL = re.compile(r"^[ \t>*_#]*(user|assistant|system|human)[*_]*[ \t]*:", re.IGNORECASE | re.MULTILINE)
TEMPLATE_TOKEN = re.compile(
    r"<\|[A-Za-z0-9_]+\|>|\[/?INST\]|<</?SYS>>|<(?:start|end)_of_turn>|</?think>|</?s>", re.IGNORECASE
)
# The chatter of an assistant around what it was asked to write, at a chunk's start or end.
CHATTER_START = re.compile(
    r"^\W*(sure\b|certainly\b|of course\b|absolutely\b|here is\b|here's\b|as an ai\b|i'm sorry\b|"
    r"i am sorry\b|i can't\b|i cannot\b|okay, here\b)",
    re.IGNORECASE,
)
CHATTER_END = re.compile(
    r"(let me know if\b|would you like me to\b|i hope this\b|shall i continue\b)[^\n]*\W*$", re.IGNORECASE
)
PASSAGE_REFERENCE = re.compile(
    r"\b(this|the above|the given|the following) (passage|excerpt|text|chunk)\b",
    re.IGNORECASE,
)


def _markers(text: str) -> list[str]:
    found = [m.group(0).strip(" \t>*_#") for m in ROLE_LABEL.finditer(text)]
    return found + [m.group(0) for m in TEMPLATE_TOKEN.finditer(text)]


# ---------------------------------------------------------------------- the rules
@rule("context_below_target", "the context is shorter than the token target it was generated for")
def _below_target(c: Candidate, s: RuleSettings):
    if c.context_tokens < c.target_tokens:
        yield None, f"{c.context_tokens} tokens < target {c.target_tokens}"


@rule("context_over_cap", "the trainer would truncate the context (stage-2 histories are written whole)")
def _over_cap(c: Candidate, s: RuleSettings):
    if c.context_tokens > s.max_context_tokens:
        yield None, f"{c.context_tokens} tokens > cap {s.max_context_tokens}"


@rule("email_outside_example_domains", "e-mail addresses must use reserved example domains (RFC 2606)")
def _emails(c: Candidate, s: RuleSettings):
    bad = sorted(
        {m.group(0) for m in EMAIL.finditer(c.context) if not email_allowed(m.group(1), s.email_domains)}
    )
    if bad:
        yield None, ", ".join(bad[:5]) + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else "")
    for i, qa in enumerate(c.qas):
        for m in EMAIL.finditer(f"{qa.question}\n{qa.answer}"):
            if not email_allowed(m.group(1), s.email_domains):
                yield i, m.group(0)


@rule("role_marker", "conversation-role labels or chat-template tokens leaked into the text")
def _role_markers(c: Candidate, s: RuleSettings):
    found = _markers(c.context)
    if found:
        shown = sorted(set(found))
        yield None, f"{len(found)}x: " + ", ".join(map(repr, shown[:5]))
    for i, qa in enumerate(c.qas):
        found = _markers(f"{qa.question}\n{qa.answer}")
        if found:
            yield i, ", ".join(map(repr, sorted(set(found))))


@rule("assistant_chatter", "a chunk opens or closes with the generator talking to its user, or refusing")
def _chatter(c: Candidate, s: RuleSettings):
    for k, chunk in enumerate(c.chunks()):
        for pattern in (CHATTER_START, CHATTER_END):
            m = pattern.search(chunk)
            if m:
                yield None, f"chunk {k}: {_short(m.group(0))}"


@rule("question_reveals_answer", "the question contains its own answer")
def _reveals(c: Candidate, s: RuleSettings):
    for i, qa in enumerate(c.qas):
        answer = normal(qa.answer)
        if answer and f" {answer} " in f" {normal(qa.question)} ":
            yield i, _short(qa.question)


@rule("answer_length", "the answer is outside the target-token range")
def _answer_length(c: Candidate, s: RuleSettings):
    for i, qa in enumerate(c.qas):
        if not s.min_answer_tokens <= qa.answer_tokens <= s.max_answer_tokens:
            yield (
                i,
                f"{qa.answer_tokens} tokens ({_short(qa.answer, 40)}), "
                + (f"expected {s.min_answer_tokens}-{s.max_answer_tokens}"),
            )


@rule("answer_not_in_context", "too few of the answer's words occur in the context: it is not recoverable")
def _grounded(c: Candidate, s: RuleSettings):
    words = set(normal(c.context).split())
    for i, qa in enumerate(c.qas):
        answer = normal(qa.answer).split()
        if not answer:
            yield i, "empty answer"
            continue
        share = sum(w in words for w in answer) / len(answer)
        if share < s.min_answer_overlap:
            yield i, f"{share:.0%} of {_short(qa.answer, 40)} found, expected >= {s.min_answer_overlap:.0%}"


@rule("question_refers_to_passage", "the question points at a passage the trainee never sees with it")
def _refers(c: Candidate, s: RuleSettings):
    for i, qa in enumerate(c.qas):
        m = PASSAGE_REFERENCE.search(qa.question)
        if m:
            yield i, f"{m.group(0)!r} in {_short(qa.question)}"


@rule("duplicate_question", "the same question (ignoring case and punctuation) is asked twice")
def _duplicates(c: Candidate, s: RuleSettings):
    seen: dict[str, int] = {}
    for i, qa in enumerate(c.qas):
        key = normal(qa.question)
        if key in seen:
            yield i, f"same as question {seen[key]}: {_short(qa.question)}"
        else:
            seen[key] = i


@rule("too_few_questions", "a context needs questions to be a training episode")
def _too_few(c: Candidate, s: RuleSettings):
    if len(c.qas) < s.min_questions:
        yield None, f"{len(c.qas)} question(s) < {s.min_questions}"


# ---------------------------------------------------------------------- verdicts and the report
@dataclass(frozen=True)
class Verdict:
    """The outcome for one candidate: accepted or not, every finding, the questions kept."""

    accepted: bool
    findings: tuple[Finding, ...]
    kept: tuple[int, ...]

    def to_json(self) -> dict:
        return {
            "accepted": self.accepted,
            "findings": [f.to_json() for f in self.findings],
            "kept": list(self.kept),
        }


def check_rule_names(names: Iterable[str]) -> tuple[str, ...]:
    """``names`` as a tuple, or a ``ValueError`` naming the unknown ones and the known rules."""
    names = tuple(names)
    unknown = [n for n in names if n not in RULES]
    if unknown:
        raise ValueError(f"unknown rule(s) {unknown}; the rules are {sorted(RULES)}")
    return names


def judge(
    candidate: Candidate,
    settings: RuleSettings,
    drop_bad_questions: bool = False,
    skip: Iterable[str] = (),
) -> Verdict:
    """Run every rule of :data:`RULES` (but those named in ``skip``) on ``candidate``.

    Default (the paper): any finding rejects the candidate. With ``drop_bad_questions``, questions
    with findings are dropped, the rules run again on what is left, and the candidate is rejected
    only for context-level findings (``too_few_questions`` among them).
    """
    rules = [r for name, r in RULES.items() if name not in set(check_rule_names(skip))]

    def run(c: Candidate) -> list[Finding]:
        return [f for r in rules for f in r(c, settings)]

    findings = run(candidate)
    every = tuple(range(len(candidate.qas)))
    flagged = {f.question for f in findings if f.question is not None}
    if not drop_bad_questions or not flagged:
        accepted = not findings
        return Verdict(accepted, tuple(findings), every if accepted else ())
    kept = tuple(i for i in every if i not in flagged)
    rest = run(replace(candidate, qas=tuple(candidate.qas[i] for i in kept)))
    dropped = [f for f in findings if f.question is not None]
    return Verdict(not rest, tuple(dropped + rest), kept if not rest else ())


def rule_report(verdicts: dict[str, Verdict]) -> dict:
    """Counts per rule over ``{candidate id: verdict}``, and every rejected candidate with its findings.

    ``rules[name]`` holds the reason, ``rejected`` (candidates rejected with a finding of this rule)
    and ``findings`` (how many it found, dropped questions included).
    """
    rules = {name: {"reason": r.reason, "rejected": 0, "findings": 0} for name, r in RULES.items()}
    rejected = []
    for cid, verdict in verdicts.items():
        for name in {f.rule for f in verdict.findings}:
            rules[name]["rejected"] += not verdict.accepted
        for f in verdict.findings:
            rules[f.rule]["findings"] += 1
        if not verdict.accepted:
            rejected.append(
                {
                    "id": cid,
                    "rules": sorted({f.rule for f in verdict.findings}),
                    "findings": [f.to_json() for f in verdict.findings],
                }
            )
    accepted = sum(v.accepted for v in verdicts.values())
    return {
        "candidates": len(verdicts),
        "accepted": accepted,
        "rejected": len(verdicts) - accepted,
        "rules": rules,
        "rejected_candidates": rejected,
    }


def report_table(report: dict) -> str:
    """The rule report as a markdown table (rule, reason, candidates rejected, findings)."""
    lines = [
        f"{report['accepted']} of {report['candidates']} candidates accepted, {report['rejected']} rejected",
        "",
        "| rule | rejected | findings | why |",
        "| --- | ---: | ---: | --- |",
    ]
    for name, row in report["rules"].items():
        lines.append(f"| {name} | {row['rejected']} | {row['findings']} | {row['reason']} |")
    return "\n".join(lines)


def token_stats(values: Sequence[int]) -> dict:
    """``{"count", "min", "median", "mean", "max"}`` of token counts (zeros for an empty list)."""
    if not values:
        return {"count": 0, "min": 0, "median": 0, "mean": 0, "max": 0}
    return {
        "count": len(values),
        "min": min(values),
        "median": statistics.median(values),
        "mean": round(statistics.fmean(values), 1),
        "max": max(values),
    }


def dataset_report(verdicts: dict[str, Verdict], records: Sequence[dict], rows: Sequence[dict]) -> dict:
    """:func:`rule_report` plus the counts and token statistics of a build.

    Args:
        verdicts: ``{candidate id: verdict}`` of every judged candidate.
        records: the journal records (their ``usage`` counts requests and endpoint tokens).
        rows: the accepted records as written (``qas`` holding the kept questions).
    """
    report = rule_report(verdicts)
    groups: dict[int, list[int]] = {}
    for row in rows:
        groups.setdefault(row["target_tokens"], []).append(row["context_tokens"])
    report.update(
        questions=sum(len(row["qas"]) for row in rows),
        requests=sum(r["usage"]["requests"] for r in records),
        usage={k: sum(r["usage"][k] for r in records) for k in ("prompt_tokens", "completion_tokens")},
        context_tokens=token_stats([row["context_tokens"] for row in rows]),
        by_target={str(t): token_stats(v) for t, v in sorted(groups.items())},
        answer_tokens=token_stats([qa["answer_tokens"] for row in rows for qa in row["qas"]]),
        questions_per_context=token_stats([len(row["qas"]) for row in rows]),
    )
    return report


def dataset_card(report: dict, data_file: str = "train.jsonl") -> str:
    """The README.md of a built dataset from its :func:`dataset_report` (with ``tokenizer`` and
    ``settings`` added): YAML header (the ``data_file`` config, tags), use, counts, statistics,
    settings, the rule report, the citation."""
    from huggingface_hub import DatasetCardData

    from lstmem_peft.utils.version import __version__

    n = report["accepted"]
    size = "n<1K" if n < 1000 else "1K<n<10K"
    header = DatasetCardData(
        language=["en"], pretty_name="LSTMem Long dataset", task_categories=["question-answering"],
        tags=["lstmem", "long-context", "memory", "synthetic"], size_categories=[size],
        configs=[{"config_name": "default", "data_files": [{"split": "train", "path": data_file}]}],
    )  # fmt: skip

    def stats(s: dict) -> str:
        return f"{s['min']:,} / {s['median']:,} / {s['mean']:,} / {s['max']:,}" if s["count"] else "-"

    settings = {k: v for k, v in report["settings"].items() if k != "topics"}
    topics = len(report["settings"]["topics"])
    lines = [
        "---", header.to_yaml(), "---", "", "# LSTMem Long dataset", "",
        "Synthetic long-horizon memory episodes in the shape of the stage-2 Long dataset of the LSTMem paper",
        "(App. C.4): each record is one long generated context and questions whose short answers are stated in",
        f"it. Built with `lstmem data long` (lstmem-peft {__version__}) through an OpenAI-compatible endpoint;",
        f"token counts use the tokenizer `{report['tokenizer']}`.", "",
        "```python", "from lstmem_peft.training.data import load_episodes", "",
        'episodes = load_episodes("<this repo id or folder>", "long_qa")  # one episode per question', "```", "",
        "A record: `{\"id\", \"topic\", \"target_tokens\", \"context_tokens\", \"context\", \"qas\": [{\"question\",",
        "\"answer\", \"answer_tokens\", \"chunk\"}]}` (`chunk`: the generated chunk the question is about).", "",
        "## Counts", "", "| | |", "| --- | --- |",
        f"| contexts accepted / candidates | {n} / {report['candidates']} |",
        f"| questions | {report['questions']:,} |",
        f"| requests (retries included) | {report['requests']:,} |",
        f"| context tokens min / median / mean / max | {stats(report['context_tokens'])} |",
        *(f"| target {int(t):,}: contexts, tokens min-max | {s['count']}, {s['min']:,}-{s['max']:,} |"
          for t, s in report["by_target"].items()),
        f"| answer tokens min / median / mean / max | {stats(report['answer_tokens'])} |",
        f"| questions per context min / median / mean / max | {stats(report['questions_per_context'])} |", "",
        "## Build settings", "", "| setting | value |", "| --- | --- |",
        *(f"| {k} | `{json.dumps(v)}` |" for k, v in settings.items()), f"| topics | {topics} |", "",
        "## Automatic checks", "", report_table(report), "",
        "## Citation", "", "```bibtex", K.PAPER_BIBTEX, "```", "",
    ]  # fmt: skip
    return "\n".join(lines)
