"""MemoryAgentBench's prompt text under both protocols, and how a context is cut to fit it.

* ``official``: the long-context agent's system message, each context chunk (:func:`sentence_chunks`:
  sentences packed into 4,096 ``gpt-4o-mini`` tiktoken tokens) in the source's ``memorize`` template,
  then the source's ``query`` template (:data:`OFFICIAL_MEMORIZE`, :data:`OFFICIAL_QUERY`);
* ``paper``: δ-Mem's one-turn template around the raw context (:data:`PAPER_HEAD`,
  :data:`PAPER_QUESTION`), the context pre-clipped as its suite does (:func:`paper_clip`).

The templates are the released code's text, word for word; :mod:`lstmem_peft.eval.mab` puts them
together per source.
"""

from __future__ import annotations

from collections.abc import Callable

CHUNK_TOKENS = 4096  # every source's chunk_size in the official data configs
TIME_STAMP = "2025-01-01 00:00:00"  # fills {time_stamp}; the official code stamps the wall clock

# ---------------------------------------------------------------------- templates (data, word for word)
# Source: HUST-AI-HYZ/MemoryAgentBench, utils/templates.py (SYSTEM_MESSAGE; BASE_TEMPLATES[...]["memorize"]
# and ["query"]["long_context_agent"]), after Python's str.format: "\\n" in the memorize templates is a
# backslash and an n, "{{label}}" became the literal "{label}".
OFFICIAL_SYSTEM = (
    "You are a helpful assistant that can read the context and memorize it for future retrieval."
)
OFFICIAL_MEMORIZE = {
    "ruler_qa": "Dialogue between User and Assistant {time_stamp}\\n<User> The following context is the "
    "documents I have read: \n{context}\n <Assistant> I have learned the documents and I will answer the "
    "question you ask.",
    "longmemeval": "Dialogue between User and Assistant \\n<User> The following context is the conversation "
    "between the user and the assistant: \n{context}\n <Assistant> I have memorized the conversation and I "
    "will answer the question you ask.",
    "eventqa": "Dialogue between User and Assistant {time_stamp}\\n<User> The following context is the book "
    "excerpt: \n{context}\n <Assistant> I have read the book excerpt and I will answer the question you ask.",
    "icl_": "Dialogue between User and Assistant {time_stamp} \\n<User> The following context is the examples "
    "I have learned: \n{context}\n <Assistant> I have learned the examples and I will answer the question "
    "you ask.",
    "recsys_redial": "Dialogue between User and Assistant {time_stamp} \\n<User> The following context is the "
    "dialogues between a user and recommender system: \n{context}\n <Assistant> I have memorized the "
    "dialogues and I will answer the question you ask.",
    "infbench_sum": "Dialogue between User and Assistant {time_stamp} \\n<User> The following context is the "
    "book I have read: \n{context}\n <Assistant> I have read the book and I will answer the question you ask.",
    "detective_qa": "Dialogue between User and Assistant {time_stamp} \\n<User> The following context is the "
    "book I have read: \n{context}\n <Assistant> I have read the book and I will answer the question you ask.",
    "factconsolidation": "Dialogue between User and Assistant {time_stamp} \\n<User> The following context is "
    "the facts I have learned: \n{context}\n <Assistant> I have learned the facts and I will answer the "
    "question you ask.",
}
OFFICIAL_QUERY = {
    "ruler_qa": "Answer the question based on the memorized documents. Only give me the answer and do not "
    "output any other words. \n\nQuestion: {question} \n\n Answer:",
    "longmemeval": "The history chats are between you and a user. Based on the relevant chat history, answer "
    "the question as concisely as you can, using a single phrase if possible.\n\n {question} \n\n Answer:",
    "eventqa": "Based on the context you memorized, complete the task below:\n\n{question}\n\n The event that "
    "happens next is:",
    "icl_": "Use the provided mapping from the context to numerical label to assign a numerical label to the "
    'context. Only output "label: {{label}}" and nothing else. \n\n{question} \n\n label:',
    "recsys_redial": "Pretend you are a movie recommender system. You need to recommend movies based on the "
    "dialogues you have memorized. Now I will give you a new conversation between a user and you (a "
    "recommender system). Based on the conversation, you reply me with 20 recommendations without extra "
    "sentences. \n\nFor Example:\n\n[Conversation]\n\nThe recommendations are: \n1.movie1\n2.movie2\n...\n\n "
    "Here is the conversation: {question} \n\n The recommendations are: \n",
    "infbench_sum": "You are given a book above and you are tasked to summarize it. \n\n{question} \n\n Now "
    "summarize the book.",
    "detective_qa": "Based on the context you memorized, answer the question below. You are required to answer "
    "the question based on the strict output format.\n\n {question} \n\n",
    "factconsolidation": "Pretend you are a knowledge management system. Each fact in the knowledge pool is "
    "provided with a serial number at the beginning, and the newer fact has larger serial number. \n You need "
    "to solve the conflicts of facts in the knowledge pool by finding the newest fact with larger serial "
    "number. You need to answer a question based on this rule. You should give a very concise answer without "
    "saying other words for the question **only** from the knowledge pool you have memorized rather than the "
    "real facts in real world. \n\nFor example:\n\n [Knowledge Pool] \n\n Question: Based on the provided "
    "Knowledge Pool, what is the name of the current president of Russia? \nAnswer: Donald Trump \n\n Now "
    "Answer the Question: Based on the provided Knowledge Pool, {question} \nAnswer:",
}
# Source: declare-lab/delta-Mem, deltamem/eval/benchmark_compare.py, MEMORY_CONTEXT_QA_PROMPT_TEMPLATE
# (split at {context}: the part before it opens the history, the part after it is the question prompt).
PAPER_HEAD = (
    "Use only the memory context below to answer the question.\n"
    "Reply with a short entity, phrase, number, or sentence only.\n"
    "If the answer is not supported by the context, reply exactly: I don't know.\n\n"
)
PAPER_QUESTION = "\n\nQuestion: {question}\nAnswer:"
# Source: declare-lab/delta-Mem, deltamem/eval/benchmark_compare.py, clip_context_text (the marker) and
# scripts/run_qasper_multimodel_write8192_benchmark_suite*.sh (--memory-agent-bench-max-context-chars 120000).
CLIP_MARKER = "\n\n[... context truncated ...]\n\n"
PAPER_MAX_CONTEXT_CHARS = 120_000


def paper_clip(text: str, max_chars: int = PAPER_MAX_CONTEXT_CHARS) -> str:
    """δ-Mem's pre-clip of a MemoryAgentBench context (the ``paper`` protocol), character for character.

    Read in ``deltamem/eval/benchmark_compare.py`` of declare-lab/delta-Mem at commit
    ``5cd5d9153c7f408764728d953565201e198c39e2`` (the file is unchanged since it was added in
    ``2e9a67c4c684e33964d39a40601041d2bd53196a``): ``clip_context_text``, which
    ``evaluate_memory_agent_bench`` applies to every row's raw ``context`` (every source, both of its
    prompt paths) before any templating or chunking, with the limit of
    ``--memory-agent-bench-max-context-chars`` (120,000 in the suite scripts).

    A text of at most ``max_chars`` characters, or any text when ``max_chars <= 0``, is returned as
    it is. Otherwise ``room = max_chars - len(CLIP_MARKER)`` (the marker is 31 characters): when
    ``room <= 32`` the result is the last ``max_chars`` characters, with no marker; else the first
    ``room // 3`` characters with trailing whitespace stripped, :data:`CLIP_MARKER`, and the last
    ``room - room // 3`` characters with leading whitespace stripped. For 120,000: the first 39,989
    and the last 79,980 characters, so at most 120,000 in all.
    """
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    room = max_chars - len(CLIP_MARKER)
    if room <= 32:
        return text[len(text) - max_chars :]
    head = room // 3  # room >= 33 here, so head >= 11 and the tail keeps the other two thirds
    tail = room - head
    return text[:head].rstrip() + CLIP_MARKER + text[len(text) - tail :].lstrip()


# ---------------------------------------------------------------------- official chunking
def sentence_chunks(
    text: str,
    chunk_tokens: int = CHUNK_TOKENS,
    count_tokens: Callable[[str], int] | None = None,
    split_sentences: Callable[[str], list[str]] | None = None,
) -> list[str]:
    """The context cut as the official ``chunk_text_into_sentences``: sentences (nltk's punkt) packed
    greedily while the chunk's summed sentence token counts stay within ``chunk_tokens``, sentences
    of a chunk joined by one space. A sentence that alone exceeds the limit closes the chunk before
    it, so a first sentence that long leaves an empty first chunk, as in the official code.

    Args:
        count_tokens: tokens in a sentence; default: tiktoken's ``gpt-4o-mini`` encoding (needs the
            ``tiktoken`` package and its cached encoding file).
        split_sentences: default ``nltk.sent_tokenize``.
    """
    if count_tokens is None:
        count_tokens = _tiktoken_counter()
    if split_sentences is None:
        split_sentences = _punkt_sentences
    chunks: list[str] = []
    current: list[str] = []
    used = 0
    for sentence in split_sentences(text):
        n = count_tokens(sentence)
        if used + n > chunk_tokens:
            chunks.append(" ".join(current))
            current, used = [sentence], n
        else:
            current.append(sentence)
            used += n
    if current:
        chunks.append(" ".join(current))
    return chunks


def _punkt_sentences(text: str) -> list[str]:
    """``nltk.sent_tokenize``, with a clear error when its punkt data is not installed."""
    import nltk

    try:
        return nltk.sent_tokenize(text)
    except LookupError:
        raise LookupError(
            "the official MemoryAgentBench protocol splits contexts into sentences with nltk's punkt model, "
            "which is not installed: python -m nltk.downloader punkt_tab (or pass split_sentences=)"
        ) from None


def _tiktoken_counter() -> Callable[[str], int]:
    try:
        import tiktoken
    except ImportError:
        raise ImportError(
            "the official MemoryAgentBench protocol chunks contexts with tiktoken's gpt-4o-mini encoding: "
            "pip install tiktoken (its encoding file must be cached for offline runs), or pass count_tokens="
        ) from None
    try:
        encoding = tiktoken.encoding_for_model("gpt-4o-mini")
    except OSError as err:  # the encoding file is downloaded on first use
        raise OSError(
            "the official MemoryAgentBench protocol counts chunk tokens with tiktoken's gpt-4o-mini encoding "
            f"(o200k_base), which could not be loaded ({type(err).__name__}): tiktoken downloads it once into "
            "TIKTOKEN_CACHE_DIR; on an offline machine copy a cached o200k_base file there, or pass "
            "--chunk-tokenizer model (count_tokens=)"
        ) from None
    return lambda text: len(encoding.encode(text, allowed_special={"<|endoftext|>"}))
