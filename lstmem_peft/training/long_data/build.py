"""Generating candidates, the resumable journal, the outputs (data, report, card), the Hub upload and
the command line of ``lstmem data long``."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import math
import os
import signal
import sys
import threading
from dataclasses import dataclass, fields

from lstmem_peft.utils.errors import MissingDataError

from .config import (
    CARD,
    DATA,
    PUBLISHED,
    QA_SYSTEM,
    REPORT,
    WORDS_PER_TOKEN,
    WRITER_SYSTEM,
    LongDataConfig,
    candidate_id,
    count_tokens,
    load_tokenizer,
    plan,
)
from .endpoint import BadReply, Endpoint
from .journal import Journal, open_build, write_json, write_settings
from .rules import (
    QA,
    Candidate,
    RuleSettings,
    Verdict,
    dataset_card,
    dataset_report,
    judge,
    report_table,
)


# ---------------------------------------------------------------------- prompts and replies
def chunk_messages(config: LongDataConfig, index: int, part: int, text_so_far: str) -> list[dict]:
    """The request for chunk ``part`` of candidate ``index``: its brief and the tail of the text so far."""
    topic, target, words = plan(config, index)
    parts = math.ceil(target / config.chunk_tokens)
    size = f"about {round(target * WORDS_PER_TOKEN):,} words in about {parts} parts"
    ask = f"write part {part + 1} now, about {round(config.chunk_tokens * WORDS_PER_TOKEN):,} words"
    if part == 0:
        user = f"Write the opening of a document: {topic}. Work in {', '.join(words)}. The whole document "
        user += f"will run to {size}; {ask}."
    else:
        tail = text_so_far[-config.tail_chars :]
        tail = tail[tail.find(" ") + 1 :] if len(text_so_far) > config.tail_chars else tail
        user = (
            f"You are writing a document: {topic}. It will run to {size}. The text so far ends:\n\n"
            f"<<<\n{tail}\n>>>\n\nNow {ask}, continuing seamlessly from that point. Bring in new people, "
            "events and concrete details rather than repeating earlier ones. Reply with the new text only."
        )
    return [{"role": "system", "content": WRITER_SYSTEM}, {"role": "user", "content": user}]


def qa_messages(config: LongDataConfig, index: int, chunk: str) -> list[dict]:
    """The request for ``questions_per_chunk`` questions about one chunk."""
    low, high = (max(1, round(t * WORDS_PER_TOKEN)) for t in config.answer_tokens)
    n = config.questions_per_chunk
    user = (
        f"Below is an excerpt of a longer document ({plan(config, index)[0]}).\n\n<<<\n{chunk}\n>>>\n\n"
        f"Write {n} question{'s' if n > 1 else ''} about specific facts stated in the excerpt. Each answer is "
        f"a short phrase of {low} to {high} words taken from the excerpt. A question must not contain its "
        "answer, must make sense on its own (name people, places and things; never say 'the excerpt' or "
        "'the passage'), and no two questions may ask the same thing. Reply as JSON: "
        '{"qas": [{"question": "...", "answer": "..."}]}'
    )
    return [{"role": "system", "content": QA_SYSTEM}, {"role": "user", "content": user}]


def parse_qas(text: str, most: int) -> list[tuple[str, str]]:
    """The ``(question, answer)`` pairs of a JSON reply (a code fence around it is allowed), at most
    ``most``; :class:`BadReply` when the reply is not ``{"qas": [{"question": str, "answer": str}, ...]}``."""
    start, end = text.find("{"), text.rfind("}")
    try:
        value = json.loads(text[start : end + 1]) if 0 <= start < end else None
    except json.JSONDecodeError as err:
        raise BadReply(f"question reply is not JSON ({err.msg})") from None
    except RecursionError:
        raise BadReply("question reply is not JSON (nested too deep)") from None
    items = value.get("qas") if isinstance(value, dict) else None
    pairs = [
        (item["question"].strip(), item["answer"].strip())
        for item in (items if isinstance(items, list) else [])
        if isinstance(item, dict)
        and isinstance(item.get("question"), str)
        and isinstance(item.get("answer"), str)
    ]
    pairs = [(q, a) for q, a in pairs if q and a]
    if not pairs:
        raise BadReply(f'question reply holds no {{"question", "answer"}} pairs: {text[:80]!r}')
    return pairs[:most]


async def _all(coroutines) -> list:
    """``asyncio.gather`` that cancels the others when one fails (no request outlives the failure)."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def generate_candidate(endpoint: Endpoint, tokenizer, index: int) -> dict:
    """Generate candidate ``index``: chunks until its target, then questions about every chunk.

    Returns the journal record (without the verdict): ``{"id", "index", "topic", "target_tokens",
    "context", "chunk_starts", "context_tokens", "qas", "usage"}`` (``usage``: requests, retries
    included, and the endpoint's prompt and completion token counts).
    """
    c = endpoint.config
    cid, (topic, target, _) = candidate_id(c.seed, index), plan(c, index)
    usage = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}
    context, starts, tokens = "", [], 0
    most_chunks = 2 * math.ceil(target / c.chunk_tokens) + 2  # then context_below_target rejects it

    def add(used: dict) -> None:
        for k in usage:
            usage[k] += used[k]

    while tokens < target and len(starts) < most_chunks:
        text, used = await endpoint.chat(
            chunk_messages(c, index, len(starts), context),
            request_id=f"{cid}/chunk-{len(starts):03d}",
            max_tokens=c.max_reply_tokens or 2 * c.chunk_tokens,
            parse=str,
        )
        add(used)
        context += "\n\n" if context else ""
        starts.append(len(context))
        context += text
        tokens = count_tokens(tokenizer, context)
    chunks = Candidate(cid, context, (), tokens, target, tuple(starts)).chunks()
    replies = await _all(
        (
            endpoint.chat(
                qa_messages(c, index, chunk),
                request_id=f"{cid}/qa-{k:03d}",
                max_tokens=256 + 128 * c.questions_per_chunk,
                parse=lambda text: parse_qas(text, c.questions_per_chunk),
                json_mode=c.json_mode,
            )
            for k, chunk in enumerate(chunks)
        )
    )
    qas = []
    for k, (pairs, used) in enumerate(replies):
        add(used)
        for q, a in pairs:
            qas.append(
                {"question": q, "answer": a, "answer_tokens": count_tokens(tokenizer, " " + a), "chunk": k}
            )
    return {
        "id": cid, "index": index, "topic": topic, "target_tokens": target, "context": context,
        "chunk_starts": starts, "context_tokens": tokens, "qas": qas,
        "usage": usage,
    }  # fmt: skip


# ---------------------------------------------------------------------- the build
def _candidate(record: dict) -> Candidate:
    qas = tuple(QA(q["question"], q["answer"], q["answer_tokens"], q.get("chunk", 0)) for q in record["qas"])
    return Candidate(
        record["id"], record["context"], qas, record["context_tokens"], record["target_tokens"],
        tuple(record["chunk_starts"]),
    )  # fmt: skip


@dataclass
class BuildResult:
    """What :func:`build_long_dataset` wrote: the folder, the data file and the report."""

    out_dir: str
    data_path: str
    report: dict

    @property
    def accepted(self) -> int:
        return self.report["accepted"]

    @property
    def questions(self) -> int:
        return self.report["questions"]


def build_long_dataset(config: LongDataConfig, out_dir: str, progress: bool = True) -> BuildResult:
    """Generate the candidates ``out_dir`` does not hold yet, then write the dataset, report and card.

    Rerunning with the same generation settings resumes: finished candidates are read from the
    journal, never requested again. ``build.json`` records the settings only once the tokenizer has
    loaded and the endpoint has given a usable reply, so a run that fails before (a mistyped model or
    tokenizer) blocks no corrected rerun. Raises :class:`EndpointError` when the endpoint fails for
    good (finished candidates stay in the journal), ``UsageError`` when ``out_dir`` holds finished
    candidates of other settings, ``DataFormatError`` naming a damaged ``build.json`` or journal line.
    See the module docstring for the files.
    """
    from tqdm.auto import tqdm

    os.makedirs(out_dir, exist_ok=True)
    journal, records, unrecorded = open_build(out_dir, config)
    todo = [i for i in range(config.num_candidates) if i not in records]
    if todo:
        tokenizer = load_tokenizer(config.tokenizer)
        record_settings = (lambda: write_settings(out_dir, config)) if unrecorded else None
        done = config.num_candidates - len(todo)
        bar = tqdm(total=config.num_candidates, initial=done, desc="long candidates", disable=not progress)
        try:
            _run(_generate(config, tokenizer, todo, journal, records, bar, record_settings))
        except KeyboardInterrupt:
            print(
                f"interrupted: {len(records)} finished candidates are kept in {journal.path}; rerun the same "
                "command to go on",
                file=sys.stderr,
            )
            raise
        finally:
            bar.close()
    return write_outputs(out_dir, config, [records[i] for i in sorted(records) if i < config.num_candidates])


def _run(coroutine) -> None:
    """``asyncio.run``, also from inside a running event loop (a notebook): then on its own thread.

    On the main thread, Ctrl-C raises :class:`KeyboardInterrupt` where the loop is, at once
    (:func:`_interrupt_at_once`), instead of ``asyncio.run``'s own handling (cancel the main task,
    raise once it ends cancelled), which returns normally when a library under the request (the HTTP
    client's shielded clean-up) absorbs that cancellation: a Ctrl-C then went unnoticed. The loop's
    tasks are still cancelled and their ``finally`` blocks run as ``asyncio.run`` closes."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        with _interrupt_at_once():
            return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


@contextlib.contextmanager
def _interrupt_at_once():
    """SIGINT raises ``KeyboardInterrupt`` wherever the main thread is, for the block (nothing changes
    off the main thread or where the process has its own SIGINT handler)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:
        yield
        return

    def interrupt(signum, frame):  # a handler of our own: asyncio.run then installs none
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


async def _generate(
    config, tokenizer, todo, journal: Journal, records: dict, bar, on_first_reply=None
) -> None:
    """Candidates of ``todo`` on ``concurrency`` workers; each finished one is journaled at once. After
    a failure no new candidate starts, those under way finish, then the first error is raised.
    ``on_first_reply`` runs at the endpoint's first usable reply (it records the settings)."""
    endpoint, queue, errors = Endpoint(config, on_first_reply), iter(todo), []
    settings, accepted = config.rule_settings(), 0

    async def worker():
        nonlocal accepted
        while not errors and (index := next(queue, None)) is not None:
            try:
                record = await generate_candidate(endpoint, tokenizer, index)
            except Exception as err:  # raised below, once the other workers have finished
                errors.append(err)
                return
            verdict = _verdict(record, config, settings)
            journal.append({**record, "verdict": verdict.to_json()})
            records[index] = record
            accepted += verdict.accepted
            bar.set_postfix(accepted=accepted, requests=endpoint.requests, refresh=False)
            bar.update()

    try:
        await asyncio.gather(*(worker() for _ in range(min(config.concurrency, len(todo)))))
    finally:
        await endpoint.close()
    if errors:
        raise errors[0]


def _verdict(record: dict, config: LongDataConfig, settings: RuleSettings) -> Verdict:
    return judge(_candidate(record), settings, config.drop_bad_questions, config.skip_rules)


def write_outputs(out_dir: str, config: LongDataConfig, records: list[dict]) -> BuildResult:
    """Judge ``records`` with the current rules; write ``train.jsonl``, ``report.json`` and the card."""
    settings = config.rule_settings()
    verdicts = {r["id"]: _verdict(r, config, settings) for r in records}
    rows = []
    for r in records:
        verdict = verdicts[r["id"]]
        if verdict.accepted:
            keep = ("id", "topic", "target_tokens", "context_tokens", "context")
            rows.append({**{k: r[k] for k in keep}, "qas": [r["qas"][i] for i in verdict.kept]})
    write_json(os.path.join(out_dir, DATA), rows, lines=True)
    report = dataset_report(verdicts, records, rows)
    report.update(tokenizer=config.tokenizer, settings={**config.generation(), **_rule_options(config)})
    write_json(os.path.join(out_dir, REPORT), report)
    with open(os.path.join(out_dir, CARD), "w", encoding="utf-8") as fh:
        fh.write(dataset_card(report, DATA))
    return BuildResult(out_dir, os.path.join(out_dir, DATA), report)


def _rule_options(config: LongDataConfig) -> dict:
    names = ("num_candidates", "min_questions", "drop_bad_questions", "skip_rules", "email_domains")
    return json.loads(json.dumps({k: getattr(config, k) for k in names}))


# ---------------------------------------------------------------------- the Hub
def push_to_hub(out_dir: str, repo_id: str, *, private: bool | None = None, token: str | None = None,
                commit_message: str = "Upload LSTMem Long dataset"):  # fmt: skip
    """Upload a built folder's ``train.jsonl``, ``report.json`` and ``README.md`` to the Hub *dataset*
    ``repo_id`` (created if missing). The journal and settings stay local. Returns the ``CommitInfo``."""
    from huggingface_hub import HfApi

    missing = [name for name in PUBLISHED if not os.path.isfile(os.path.join(out_dir, name))]
    if missing:
        raise MissingDataError(out_dir, f"a built Long dataset ({', '.join(PUBLISHED)})", f"no {missing}",
                               "Run build_long_dataset (lstmem data long) into it first")  # fmt: skip
    api = HfApi(token=token)
    repo = api.create_repo(repo_id, repo_type="dataset", private=private, exist_ok=True)
    return api.upload_folder(
        repo_id=repo.repo_id, repo_type="dataset", folder_path=out_dir, allow_patterns=list(PUBLISHED),
        commit_message=commit_message,
    )  # fmt: skip


# ---------------------------------------------------------------------- command line
def config_from_args(args: argparse.Namespace) -> LongDataConfig:
    """The :class:`LongDataConfig` of parsed ``lstmem data long`` options (lstmem_cli/data_long.py): an
    option left out is absent from ``args``, so the config's default applies."""
    values = {f.name: getattr(args, f.name) for f in fields(LongDataConfig) if hasattr(args, f.name)}
    return LongDataConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def run(args: argparse.Namespace) -> int:
    """``lstmem data long``: build (or resume) into ``--out``, print the rule report, push if asked.
    Exit status 0, or 1 when no candidate was accepted."""
    config = config_from_args(args)
    result = build_long_dataset(config, args.out, progress=not args.no_progress)
    report = result.report
    print(report_table(report))
    print(
        f"\n{result.questions} questions over {result.accepted} contexts "
        f"({report['context_tokens']['min']:,}-{report['context_tokens']['max']:,} tokens) in {result.data_path}; "
        f"report: {os.path.join(args.out, REPORT)}, card: {os.path.join(args.out, CARD)}"
    )
    if not result.accepted:
        print(
            f"error: every candidate was rejected; {os.path.join(args.out, REPORT)} says why", file=sys.stderr
        )
        return 1
    if args.push_to_hub:
        commit = push_to_hub(args.out, args.push_to_hub, private=args.private or None)
        print(f"uploaded to {getattr(commit, 'repo_url', args.push_to_hub)}")
    return 0
