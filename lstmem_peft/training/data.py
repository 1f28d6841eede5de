"""Episodes: what LSTMem trains and evaluates on.

An episode is a history (written into memory) and a final turn (a prompt and the answer to predict
from memory). Builders turn the supported formats into text episodes::

    {"history": str, "prompt": str, "answer": str}

and :func:`tokenize_episode` turns one into the token lists the collator pads::

    {"history_input_ids": [...], "input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer,
     "turn_writes": [], "turn_input_ids": [], "turn_labels": []}

(the empty later-turn columns of a conversation row: one dataset holds both kinds of row).

A **conversation episode** is a history and then several chat turns, each answered from memory and
then written into it as ``lstmem serve`` writes a turn::

    {"history": str, "turns": [{"prompt": str, "answer": str}, ...]}

:func:`tokenize_conversation` lays one out exactly as the server would, for a given kind of client
(one that sends only its newest message, or one that re-sends the whole conversation into a context
window), write policy and window (the one :mod:`lstmem_peft.utils.chat` rule for messages and
windows): the history, the first turn's read, and for each later turn what is written between the
previous read and its own (``turn_writes``: one list of tokens per ``write_history`` call, as the
server calls it) and its read (``turn_input_ids``, ``turn_labels``). The trainer computes the loss on
every answer (:class:`~lstmem_peft.training.trainer.LSTMemTrainer`).

Formats:

* chat JSONL: one ``{"messages": [{"role", "content"}, ...]}`` per line; the last message is the
  assistant answer, the user message before it the prompt, everything earlier the history;
* conversation JSONL: one ``{"history": str (optional), "messages": [user, assistant, user,
  assistant, ...]}`` per line: the history written into memory first, then every user/assistant
  pair a turn (a conversation episode);
* QASPER, in its public schema (``title``, ``abstract``, ``full_text.section_name/paragraphs``,
  ``qas.question/answers``): the paper is the history, one episode per answered question;
* long-document QA JSONL (the shape of the paper's Long dataset): ``{"context": str, "qas":
  [{"question": str, "answer": str}, ...]}``, one episode per question;
* synthetic key-value recall (:func:`synthetic_recall_episodes`, and
  :func:`long_recall_episodes` for histories longer than the key set) for tests and the demo.

Each loader reads a local file (``.json``/``.jsonl``/``.parquet``), a folder of them, or a Hub dataset
id (downloaded through ``huggingface_hub``, so the Hub cache serves it offline).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Iterator
from typing import Any

from lstmem_peft.memory import constants as K
from lstmem_peft.utils.chat import ChatFormat
from lstmem_peft.utils.extras import missing_extra

Episode = dict[str, str]


# ---------------------------------------------------------------------- reading records
DATA_SUFFIXES = (".parquet", ".jsonl", ".json")


def hub_dataset_folder(source: str, patterns: tuple[str, ...] = ("*.parquet", "*.jsonl", "*.json")) -> str:
    """The local folder of a Hub dataset ``owner/name`` (or ``owner/name/sub/folder``), downloaded once.

    Goes through ``huggingface_hub.snapshot_download`` (data files only), so it works offline from
    the Hub cache (``HF_HUB_OFFLINE=1``) once the dataset has been downloaded.
    """
    from huggingface_hub import snapshot_download

    parts = source.strip("/").split("/")
    if len(parts) < 2:
        raise FileNotFoundError(
            f"{source!r} is neither a local path nor a Hub dataset id (owner/name[/folder])"
        )
    repo, sub = "/".join(parts[:2]), "/".join(parts[2:])
    allow = [f"{sub}/{p}" if sub else p for p in patterns]  # fnmatch: '*' also crosses folders
    root = snapshot_download(repo, repo_type="dataset", allow_patterns=allow)
    folder = os.path.join(root, sub) if sub else root
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"Hub dataset {repo} has no folder {sub!r}")
    return folder


def data_files(folder: str, split: str) -> list[str]:
    """The data files of ``split`` in a folder: its only data file, or those named after the split."""
    paths = sorted(
        os.path.join(d, f) for d, _, files in os.walk(folder) for f in files if f.endswith(DATA_SUFFIXES)
    )
    if len(paths) == 1:
        return paths
    chosen = [p for p in paths if os.path.basename(p).lower().startswith(split.lower())]
    if not chosen:
        names = ", ".join(os.path.relpath(p, folder) for p in paths) or "none"
        raise FileNotFoundError(f"{folder}: no data file named after split {split!r} (data files: {names})")
    return chosen


def read_file(path: str) -> Iterator[dict[str, Any]]:
    """Records of one ``.parquet``, ``.jsonl`` or ``.json`` file (a JSON object maps ids to records)."""
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ModuleNotFoundError as err:
            raise missing_extra(err, "eval", f"Reading {path}") from err

        yield from pq.read_table(path).to_pylist()
        return
    with open(path, encoding="utf-8") as fh:
        if path.endswith(".jsonl"):
            for n, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{path}:{n}: not valid JSON ({err.msg})") from err
            return
        data = json.load(fh)
    if isinstance(data, dict):  # QASPER's official files map paper ids to papers
        for key, value in data.items():
            yield {"id": key, **value} if isinstance(value, dict) else value
    else:
        yield from data


def read_records(source: str, split: str = "train") -> Iterator[dict[str, Any]]:
    """Records from a local data file, a local folder, or a Hub dataset id (``owner/name[/folder]``).

    A folder (or a downloaded Hub dataset) contributes its only data file, or the files whose names
    start with ``split`` (``validation-00000-of-00001.parquet``, ``train.jsonl``).
    """
    if os.path.isfile(source):
        yield from read_file(source)
        return
    folder = source if os.path.isdir(source) else hub_dataset_folder(source)
    for path in data_files(folder, split):
        yield from read_file(path)


# ---------------------------------------------------------------------- builders
def chat_episodes(records: Iterable[dict[str, Any]]) -> Iterator[Episode]:
    """Chat transcripts -> episodes (history turns, final user prompt, final assistant answer)."""
    for n, record in enumerate(records):
        messages = record.get("messages")
        if not messages or len(messages) < 2:
            raise ValueError(
                f"chat record {n} needs a 'messages' list with at least a user turn and an answer"
            )
        *before, prompt, answer = messages
        if answer.get("role") != "assistant" or prompt.get("role") != "user":
            raise ValueError(f"chat record {n} must end with a user message followed by the assistant answer")
        history = "\n".join(f"{m['role']}: {m['content']}" for m in before)
        yield {
            "history": history,
            "prompt": f"user: {prompt['content']}\nassistant:",
            "answer": " " + answer["content"],
        }


def _qasper_answer(answer: dict[str, Any]) -> str | None:
    if answer.get("unanswerable"):
        return None
    if answer.get("free_form_answer"):
        return answer["free_form_answer"]
    if answer.get("extractive_spans"):
        return ", ".join(answer["extractive_spans"])
    if answer.get("yes_no") is not None:
        return "Yes" if answer["yes_no"] else "No"
    return None


def _rows(table: Any, keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """QASPER stores lists of records either row-wise (official JSON) or column-wise (Hub dataset)."""
    if isinstance(table, dict):
        columns = [table.get(k, []) for k in keys]
        return [dict(zip(keys, values, strict=True)) for values in zip(*columns, strict=True)]
    return list(table or [])


def qasper_episodes(records: Iterable[dict[str, Any]]) -> Iterator[Episode]:
    """QASPER papers -> one episode per answered question; the paper is the history.

    Reads both public layouts: the official JSON release (``full_text`` and ``qas`` as lists of
    records, ``answers[i]["answer"]`` a dict) and the Hub dataset (columns of lists).
    """
    for paper in records:
        sections = [
            f"{sec.get('section_name') or ''}\n" + "\n".join(sec.get("paragraphs") or [])
            for sec in _rows(paper.get("full_text"), ("section_name", "paragraphs"))
        ]
        history = "\n\n".join([paper.get("title", ""), paper.get("abstract", ""), *sections]).strip()
        for qa in _rows(paper.get("qas"), ("question", "answers")):
            answers = qa.get("answers") or []
            if isinstance(answers, dict):  # Hub layout: {"answer": [...], "annotation_id": [...], ...}
                answers = [{"answer": a} for a in answers.get("answer", [])]
            found = [_qasper_answer(a.get("answer") or {}) for a in answers]
            found = [a for a in found if a]
            if found:
                yield {
                    "history": history,
                    "prompt": f"Question: {qa['question']}\nAnswer:",
                    "answer": " " + found[0],
                }


def long_qa_episodes(records: Iterable[dict[str, Any]]) -> Iterator[Episode]:
    """Long-document QA (``context`` + ``qas``) -> one episode per question."""
    for n, record in enumerate(records):
        if "context" not in record or "qas" not in record:
            raise ValueError(f"long-QA record {n} needs 'context' and 'qas' fields")
        for qa in record["qas"]:
            yield {
                "history": record["context"],
                "prompt": f"Question: {qa['question']}\nAnswer:",
                "answer": " " + qa["answer"],
            }


def conversation_episodes(records: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Conversation records -> conversation episodes: the optional ``history`` text, then each
    user/assistant pair of ``messages`` as a turn (see the module docstring)."""
    for n, record in enumerate(records):
        messages = record.get("messages") or []
        roles = [m.get("role") for m in messages]
        if not messages or len(messages) % 2 or roles != ["user", "assistant"] * (len(messages) // 2):
            raise ValueError(
                f"conversation record {n} needs 'messages' alternating user and assistant, starting with "
                f"a user message and ending with an answer (got roles {roles})"
            )
        history = record.get("history") or ""
        if not isinstance(history, str):
            raise ValueError(f"conversation record {n}: 'history' must be text, got {type(history).__name__}")
        turns = [
            {"prompt": messages[i]["content"], "answer": messages[i + 1]["content"]}
            for i in range(0, len(messages), 2)
        ]
        yield {"history": history, "turns": turns}


BUILDERS = {
    "chat": chat_episodes,
    "conversation": conversation_episodes,
    "qasper": qasper_episodes,
    "long_qa": long_qa_episodes,
}


def load_episodes(source: str, fmt: str, split: str = "train") -> list[dict[str, Any]]:
    """Episodes from a local file or Hub id in one of :data:`BUILDERS`' formats."""
    if fmt not in BUILDERS:
        raise ValueError(f"unknown episode format {fmt!r}; choose one of {sorted(BUILDERS)}")
    return list(BUILDERS[fmt](read_records(source, split)))


# ---------------------------------------------------------------------- synthetic recall
def synthetic_recall_episodes(
    num_episodes: int, num_pairs: int = 8, num_keys: int = 32, num_values: int = 32, seed: int = 0
) -> list[Episode]:
    """Key-value recall: a history of facts ``k07 v19 ;`` and a question ``? k07`` answered ``v19``.

    Keys within an episode are distinct; the answer appears only in the history.
    """
    rng = random.Random(seed)
    episodes = []
    for _ in range(num_episodes):
        keys = rng.sample(range(num_keys), num_pairs)
        values = [rng.randrange(num_values) for _ in keys]
        ask = rng.randrange(num_pairs)
        history = " ".join(f"k{k:02d} v{v:02d} ;" for k, v in zip(keys, values, strict=True))
        episodes.append(
            {"history": history, "prompt": f"? k{keys[ask]:02d}", "answer": f" v{values[ask]:02d}"}
        )
    return episodes


def synthetic_conversation_episodes(
    num_episodes: int,
    num_pairs: int = 8,
    questions: int = 4,
    num_keys: int = 32,
    num_values: int = 32,
    seed: int = 0,
    facts_in: str = "turn",
    updated: int = 0,
) -> list[dict[str, Any]]:
    """Key-value recall as a conversation: the facts, then ``questions`` turns ``? k07`` -> ``v19``.

    ``facts_in="turn"``: the facts are the first chat turn, answered with nothing (the answer is the
    end of sequence alone: noted); ``"history"``: they are the history, written before the chat.
    ``updated``: then a chat turn (answered with nothing) gives that many of the keys new values,
    and the newest value is the answer. Each question asks a different fact, in random order.
    """
    if facts_in not in ("turn", "history"):
        raise ValueError(f"facts_in must be 'turn' or 'history', got {facts_in!r}")
    if not 1 <= questions <= num_pairs:
        raise ValueError(f"need 1 <= questions <= num_pairs, got {questions} and {num_pairs}")
    rng = random.Random(seed)
    episodes = []
    for _ in range(num_episodes):
        keys = rng.sample(range(num_keys), num_pairs)
        values = [rng.randrange(num_values) for _ in keys]
        facts = " ".join(f"k{k:02d} v{v:02d} ;" for k, v in zip(keys, values, strict=True))
        update = []
        if updated:
            again = rng.sample(range(num_pairs), updated)
            for i in again:
                values[i] = rng.choice([v for v in range(num_values) if v != values[i]])
            text = " ".join(f"k{keys[i]:02d} v{values[i]:02d} ;" for i in again)
            update = [{"prompt": text, "answer": ""}]
        asked = [
            {"prompt": f"? k{keys[i]:02d}", "answer": f" v{values[i]:02d}"}
            for i in rng.sample(range(num_pairs), questions)
        ]
        if facts_in == "turn":
            episodes.append({"history": "", "turns": [{"prompt": facts, "answer": ""}, *update, *asked]})
        else:
            episodes.append({"history": facts, "turns": [*update, *asked]})
    return episodes


def long_recall_episodes(
    num_episodes: int, num_facts: int, num_keys: int = 32, num_values: int = 32, seed: int = 0
) -> list[dict[str, Any]]:
    """Key-value recall over a history of any length: the asked key appears exactly once.

    The other facts cycle through shuffled orders of the remaining ``num_keys - 1`` keys (a key
    comes back every ``num_keys - 1`` facts or so, each time with a fresh value), so a history may
    hold more facts than there are keys and the question stays unambiguous; with ``num_facts <=
    num_keys`` the keys are distinct, as in :func:`synthetic_recall_episodes`. The asked fact's
    position is uniform over the history; each episode also records ``facts_after``, how many facts
    were written after the asked one (its age).
    """
    if num_facts < 1 or num_keys < 2:
        raise ValueError(f"need num_facts >= 1 and num_keys >= 2, got {num_facts} and {num_keys}")
    rng = random.Random(seed)
    episodes = []
    for _ in range(num_episodes):
        ask = rng.randrange(num_keys)
        others = [k for k in range(num_keys) if k != ask]
        keys: list[int] = []
        while len(keys) < num_facts - 1:
            order = others[:]
            rng.shuffle(order)
            keys += order
        keys = keys[: num_facts - 1]
        where = rng.randrange(num_facts)
        keys.insert(where, ask)
        values = [rng.randrange(num_values) for _ in keys]
        history = " ".join(f"k{k:02d} v{v:02d} ;" for k, v in zip(keys, values, strict=True))
        episodes.append(
            {
                "history": history,
                "prompt": f"? k{ask:02d}",
                "answer": f" v{values[where]:02d}",
                "facts_after": num_facts - 1 - where,
            }
        )
    return episodes


# ---------------------------------------------------------------------- tokenization
def _history_ids(tokenizer, text: str, max_tokens: int) -> list[int]:
    """A history's tokens as they are written into memory: BOS (when the tokenizer has one), then
    the first ``max_tokens`` tokens of ``text`` (encoded without special tokens)."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return bos + list(tokenizer(text, add_special_tokens=False)["input_ids"])[:max_tokens]


def tokenize_episode(
    tokenizer, episode: Episode, history_max_tokens: int = K.STAGE1_HISTORY_CAP, add_eos: bool = True
) -> dict[str, list]:
    """Token ids of one episode; the history keeps its first ``history_max_tokens`` tokens.

    Returns ``{"history_input_ids", "input_ids", "labels"}`` (the read: prompt then answer, ``-100``
    off the answer) and the later-turn columns of :func:`tokenize_conversation`, empty
    (``"turn_writes"``, ``"turn_input_ids"``, ``"turn_labels"``: ``[]``), so one-question rows and
    conversation rows share one dataset (``Dataset.from_list`` takes its columns from the first row);
    the collator treats empty columns as no later turns.
    """
    history = _history_ids(tokenizer, episode["history"], history_max_tokens)
    prompt = tokenizer(episode["prompt"], add_special_tokens=False)["input_ids"]
    answer = tokenizer(episode["answer"], add_special_tokens=False)["input_ids"]
    if add_eos and tokenizer.eos_token_id is not None:
        answer = answer + [tokenizer.eos_token_id]
    if tokenizer.bos_token_id is not None:
        prompt = [tokenizer.bos_token_id] + prompt
    if not answer:
        raise ValueError(f"episode has an empty answer: {episode!r}")
    return {
        "history_input_ids": history,
        "input_ids": prompt + answer,
        "labels": [-100] * len(prompt) + answer,
        "turn_writes": [],
        "turn_input_ids": [],
        "turn_labels": [],
    }


#: The kinds of chat client a conversation episode can be laid out for (:func:`tokenize_conversation`).
CLIENTS = ("newest", "resend")
#: The write policies of ``lstmem serve`` a conversation can be trained under (``none`` writes nothing,
#: so it needs no training of its own).
CONVERSATION_WRITES = ("messages", "messages_and_answer")


class ServedConversation:
    """A conversation as ``lstmem serve`` takes it in from one kind of client, turn by turn.

    The server's turn rule (:mod:`lstmem_peft.serve.runner`) on the client's side of the wire:
    the client ``"newest"`` sends each user message alone; ``"resend"`` sends the whole conversation
    so far, the answers as the assistant messages it got. The messages the session has not taken in
    yet are new; the prompt is the latest messages that fit ``window - max_tokens`` with what the
    chat template adds once (:meth:`~lstmem_peft.utils.chat.ChatFormat.fit`); new messages older than the
    prompt are written before the answer, the others after it, in one call, followed by the answer
    under ``write="messages_and_answer"`` (which the session then holds, so a re-sending client does
    not send it as new again). :func:`tokenize_conversation` lays out training episodes with it and
    :func:`lstmem_peft.cli.demo.conversation.evaluate_conversation` measures recall with it; a test
    holds both to the server's own answers.

    Use: ``before, prompt = conv.ask(text)``, answer ``prompt`` with memory read-only after writing
    ``before``, then write ``conv.answered(answer_text)``.

    Args:
        tokenizer: the served tokenizer (its chat template, if it has one, formats the messages).
        client: ``"newest"`` or ``"resend"`` (:data:`CLIENTS`).
        write: ``"messages"`` or ``"messages_and_answer"`` (:data:`CONVERSATION_WRITES`).
        window: the served context window in tokens; ``None``: unbounded.
        max_tokens: the requests' ``max_tokens`` (reserved in the window, as the server reserves it).
    """

    def __init__(
        self,
        tokenizer,
        client: str = "newest",
        write: str = "messages",
        window: int | None = None,
        max_tokens: int = 16,
    ) -> None:
        if client not in CLIENTS:
            raise ValueError(f"client must be one of {CLIENTS}, got {client!r}")
        if write not in CONVERSATION_WRITES:
            raise ValueError(f"write must be one of {CONVERSATION_WRITES}, got {write!r}")
        self.client, self.write = client, write
        self.fmt = ChatFormat(tokenizer)
        self.room = (1 << 62) if window is None else window - max_tokens  # the prompt's tokens, at most
        self.messages: list[dict[str, str]] = []  # what the client holds
        self.taken = 0  # how many of them the session has taken in
        self._after: list[int] = []

    def ask(self, text: str) -> tuple[list[int], list[int]]:
        """The user message ``text`` sent as this client sends it: ``(written before the answer,
        the prompt with the generation prompt)``; raises ``ValueError`` when it does not fit."""
        self.messages.append({"role": "user", "content": text})
        sent = self.messages if self.client == "resend" else self.messages[-1:]
        new_from = self.taken if self.client == "resend" else 0
        laid = self.fmt.fit(sent, self.room)
        encoded, first = laid.encoded, laid.first
        if first == len(encoded):
            raise ValueError(
                f"a message of {len(encoded[-1])} tokens does not fit the {laid.budget} tokens the window "
                "leaves for the prompt; raise window or lower max_tokens"
            )
        self._after = [t for i in range(max(new_from, first), len(encoded)) for t in encoded[i]]
        before = [t for i in range(new_from, first) for t in encoded[i]]
        return before, laid.tokens

    def answered(self, text: str) -> list[int]:
        """The client got the answer ``text`` (as the server sends it: stripped); returns the tokens the
        turn writes after answering, in one call (empty: nothing)."""
        self.messages.append({"role": "assistant", "content": text.strip()})
        after = self._after
        if self.write == "messages_and_answer":
            after = after + self.fmt.message("assistant", text.strip())
            self.taken = len(self.messages)
        else:
            self.taken = len(self.messages) - 1
        return after


def tokenize_conversation(
    tokenizer,
    episode: dict[str, Any],
    client: str = "newest",
    write: str = "messages",
    window: int | None = None,
    max_tokens: int = 16,
    history_max_tokens: int = K.STAGE1_HISTORY_CAP,
) -> dict[str, Any]:
    """Token ids of a conversation episode, laid out as ``lstmem serve`` runs it
    (:class:`ServedConversation`, the answers being the episode's).

    The history (when not empty) is written first, as text (``POST /v1/memory/{session}/write``),
    then the turns; each turn's read is its prompt followed by its answer and EOS.

    Args:
        tokenizer: the served tokenizer.
        episode: ``{"history": str, "turns": [{"prompt": str, "answer": str}, ...]}``.
        client, write, window, max_tokens: as :class:`ServedConversation` takes them.
        history_max_tokens: the history keeps its first this many tokens.

    Returns:
        ``{"history_input_ids": [...], "input_ids": [...], "labels": [...]`` (the first turn's read,
        ``-100`` off the answer), ``"turn_writes": [[...], ...]`` per later turn (the token lists
        written between the previous read and this one, one per ``write_history`` call, in order),
        ``"turn_input_ids"`` and ``"turn_labels"`` (the later turns' reads)``}``.

    Raises:
        ValueError: an unknown client or policy, no turns, an empty answer without an EOS token, or a
            message that does not fit the window.
    """
    turns = episode.get("turns") or []
    if not turns:
        raise ValueError("a conversation episode needs at least one turn")
    conversation = ServedConversation(tokenizer, client, write, window, max_tokens)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    history: list[int] = []
    if episode.get("history"):
        history = _history_ids(tokenizer, episode["history"], history_max_tokens)
    writes: list[list[list[int]]] = []
    reads: list[tuple[list[int], list[int]]] = []
    after: list[int] = []
    for n, turn in enumerate(turns):
        before, prompt = conversation.ask(turn["prompt"])
        writes.append([w for w in (after, before) if w])
        answer = conversation.fmt.encode_text(turn["answer"]) + eos
        if not answer:
            raise ValueError(f"turn {n} has an empty answer and the tokenizer no EOS token")
        reads.append((prompt + answer, [-100] * len(prompt) + answer))
        after = conversation.answered(turn["answer"])
    return {
        "history_input_ids": history,
        "input_ids": reads[0][0],
        "labels": reads[0][1],
        "turn_writes": writes[1:],  # the first turn's message is in its own prompt: nothing before it
        "turn_input_ids": [ids for ids, _ in reads[1:]],
        "turn_labels": [labels for _, labels in reads[1:]],
    }


def left_pad(rows: list[list[int]], value: int, device=None):
    """Left-pad token lists into ``(ids, mask)``, both ``(len(rows), longest)`` long tensors (rows
    right-aligned; empty rows all padding), on ``device`` (default: the CPU)."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), value, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r) :] = 1
    return (ids, mask) if device is None else (ids.to(device), mask.to(device))
