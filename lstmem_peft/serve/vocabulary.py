"""What text the served model can read, and the check that refuses the rest (:class:`Vocabulary`).

A tokenizer with an unknown token turns what it has no token for into that token: the embedded
demo's word-level tokenizer reads an English word as ``<pad>`` (its unknown token is its pad), a
SentencePiece tokenizer without byte fallback reads an unknown character as ``<unk>``. Served as it
is, such text would be answered from padding and written into the session's memory as padding.
So every text a request brings (chat messages, completions prompts, memory writes) is tokenized
first, on the request's own thread, and a text in which the unknown token stands for something the
client did not type as that token is refused with a 400 error (``unknown_tokens``) that names the
words, the model's vocabulary and what it reads, before any job is queued: nothing is written.
Tokenizers that represent every text (byte-level BPE, byte fallback) have no unknown token and are
never checked.

Token-id prompts are taken as they are, but their ids must be ones the model embeds
(:meth:`Vocabulary.check_ids`).
"""

from __future__ import annotations

import copy
import json
import re

from .protocol import ServeError

#: Word- and character-level vocabularies of at most this many tokens are listed in full (runs such
#: as ``k00..k31`` folded): a text must be made of them.
LISTED_TOKENS = 300
#: Unknown words named in an error, at most.
NAMED_WORDS = 20

_NUMBERED = re.compile(r"^(\D*)(\d+)$")


class Vocabulary:
    """The served model's vocabulary as requests meet it.

    Args:
        tokenizer: the served tokenizer; a copy is kept (the request handlers tokenize on their own
            thread; the scheduler's worker uses the original).
        size: the token ids the model embeds (``LoadedModel.vocab_size``).
        name: the served model's id, for messages.

    Attributes:
        tokenizer: the handlers' own copy of the tokenizer.
        unknown_ids: the ids of the tokenizer's unknown token (its ``unk_token``, or the unknown
            token of its tokenizer model, which may be its pad, as the demo's); empty when it has
            none.
        description: what the model reads, for error messages: its kind and size, and its tokens
            when there are few of them.
    """

    def __init__(self, tokenizer, size: int, name: str) -> None:
        try:
            self.tokenizer = copy.deepcopy(tokenizer)
        except Exception:  # noqa: BLE001  (a tokenizer that cannot be copied is shared)
            self.tokenizer = tokenizer
        self.size, self.name = size, name
        self.unknown_ids = _unknown_ids(self.tokenizer)
        self.description = describe(self.tokenizer, size, name)
        self.unit = _kind(self.tokenizer, _regular(self.tokenizer))[1]  # what an unknown piece is

    @classmethod
    def of(cls, loaded) -> Vocabulary:
        """The vocabulary of a :class:`~.loading.LoadedModel`."""
        return cls(loaded.tokenizer, loaded.vocab_size, loaded.name)

    # ------------------------------------------------------------------ text
    def unknown_words(self, text: str) -> list[str]:
        """The pieces of ``text`` the tokenizer reads as its unknown token (in order, repeats kept);
        the unknown token typed as itself (``<pad>``, ``<unk>``) is not one."""
        if not self.unknown_ids or not text:
            return []
        tok = self.tokenizer
        try:
            enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
            pairs = list(zip(enc["input_ids"], enc["offset_mapping"], strict=True))
        except (NotImplementedError, ValueError, TypeError, KeyError):  # no offsets (a slow tokenizer)
            return [word for word in text.split() if self._unknown_word(word)]
        words = []
        for token, (start, end) in pairs:
            if token in self.unknown_ids:
                piece = text[start:end]
                if piece != tok.convert_ids_to_tokens(token):
                    words.append(piece.strip() or piece or "?")
        return words

    def _unknown_word(self, word: str) -> bool:
        """Whether a whitespace-separated word holds the unknown token, not typed as itself."""
        if word in self.tokenizer.convert_ids_to_tokens(sorted(self.unknown_ids)):
            return False
        return any(t in self.unknown_ids for t in self.tokenizer(word, add_special_tokens=False)["input_ids"])

    def check_texts(self, texts: list[tuple[str, str]], param: str) -> None:
        """Refuse the request (400 ``unknown_tokens``) when a text has words the tokenizer reads as
        its unknown token.

        Args:
            texts: ``(where, text)`` pairs: where each text is in the request (``messages[0].content``).
            param: the request parameter named in the error.
        """
        for where, text in texts:
            words = self.unknown_words(text)
            if words:
                raise ServeError(400, self.refusal(where, words), code="unknown_tokens", param=param)

    def refusal(self, where: str, words: list[str]) -> str:
        """The message of a refused text: the unknown words, the model's vocabulary, and that
        nothing was written."""
        distinct = list(dict.fromkeys(words))
        named = ", ".join(json.dumps(w, ensure_ascii=False) for w in distinct[:NAMED_WORDS])
        more = f" and {len(distinct) - NAMED_WORDS} more" if len(distinct) > NAMED_WORDS else ""
        unknown = ", ".join(self.tokenizer.convert_ids_to_tokens(sorted(self.unknown_ids)))
        count = len(words) if len(words) > 1 else "one"
        return (
            f"{where}: the vocabulary of {self.name} has no token for {count} of its {self.unit} "
            f"({named}{more}); its tokenizer would read each as {unknown}, its unknown token, and the model "
            f"would answer and write that instead of your text, so nothing was answered or written. "
            f"{self.description}"
        )

    # ------------------------------------------------------------------ token ids
    def check_ids(self, prompts: list, param: str = "prompt") -> None:
        """Refuse token-id prompts (400) with an id the model does not embed (text prompts pass)."""
        for i, p in enumerate(prompts):
            if not isinstance(p, str) and max(p) >= self.size:
                raise ServeError(
                    400,
                    f"prompt {i} has token id {max(p)}; the vocabulary of {self.name} has {self.size} tokens, "
                    f"ids 0 to {self.size - 1}. {self.description}",
                    param=param,
                    code="invalid_value",
                )


def _unknown_ids(tokenizer) -> frozenset[int]:
    """The ids the tokenizer turns unknown text into: its ``unk_token``'s, and its tokenizer model's
    unknown token's (WordLevel, WordPiece and BPE name one; Unigram an id)."""
    ids = set()
    if getattr(tokenizer, "unk_token_id", None) is not None:
        ids.add(int(tokenizer.unk_token_id))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = getattr(backend, "model", None)
    unk = getattr(model, "unk_token", None)
    if unk:
        token = backend.token_to_id(unk)
        if token is not None:
            ids.add(int(token))
    unk_id = getattr(model, "unk_id", None)
    if isinstance(unk_id, int):
        ids.add(unk_id)
    return frozenset(ids)


def _kind(tokenizer, regular: list[str]) -> tuple[str, str]:
    """How the tokenizer reads text, in words, and what one piece of text it has no token for is."""
    model = type(getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)).__name__
    if model == "WordLevel" and regular and all(len(t) == 1 for t in regular):
        return "character-level (each character of a text must be one of them)", "characters"
    return {
        "WordLevel": ("word-level (each word of a text must be one of them)", "words"),
        "WordPiece": ("WordPiece (each word of a text must split into them)", "pieces"),
        "BPE": ("BPE", "pieces"),
        "Unigram": ("SentencePiece unigram", "pieces"),
    }.get(model, (type(tokenizer).__name__, "pieces"))


def _show(token: str) -> str:
    """A token as a message lists it: whitespace and control characters quoted."""
    return json.dumps(token) if not token.isprintable() or token.isspace() or not token else token


def fold(tokens: list[str]) -> list[str]:
    """Tokens in order, runs folded: numbered ones with one prefix and width (``k00..k31``) and
    consecutive characters (``a..z``), three or more long."""
    out: list[str] = []
    i = 0
    while i < len(tokens):
        j = i + 1
        first = _NUMBERED.match(tokens[i])
        if first:
            prefix, digits = first.groups()
            while j < len(tokens):
                m = _NUMBERED.match(tokens[j])
                if not m or m.group(1) != prefix or len(m.group(2)) != len(digits):
                    break
                if int(m.group(2)) != int(digits) + (j - i):
                    break
                j += 1
        elif len(tokens[i]) == 1 and tokens[i].isalnum():
            while (
                j < len(tokens)
                and len(tokens[j]) == 1
                and tokens[j].isalnum()
                and ord(tokens[j]) == ord(tokens[i]) + (j - i)
            ):
                j += 1
        if j - i >= 3:
            out.append(f"{_show(tokens[i])}..{_show(tokens[j - 1])}")
        else:
            out.extend(_show(t) for t in tokens[i:j])
        i = j
    return out


def describe(tokenizer, size: int, name: str) -> str:
    """What the model reads, in a sentence: its vocabulary's kind and size, and the tokens of a word-
    or character-level one of at most :data:`LISTED_TOKENS` (runs folded); for the embedded demo, its
    format too."""
    vocab = tokenizer.get_vocab()
    by_id = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    embeds = f" (the model embeds ids 0 to {size - 1})" if size != len(by_id) else ""
    text = (
        f"The vocabulary of {name} is {len(by_id)} tokens{embeds}, {_kind(tokenizer, _regular(tokenizer))[0]}"
    )
    whole = (
        type(getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)).__name__ == "WordLevel"
    )
    if whole and len(by_id) <= LISTED_TOKENS:  # a text must be made of these: list them
        text += ": " + " ".join(fold(by_id))
    text += "."
    if _is_demo(vocab):
        text += (
            " The embedded demo reads facts and questions about them: a history such as 'k07 v19 ; k12 v03 ;' "
            "and a question such as '? k07' (answer: v19)."
        )
    return text


def _regular(tokenizer) -> list[str]:
    """The tokenizer's tokens that are not special tokens."""
    special = set(getattr(tokenizer, "all_special_tokens", []) or [])
    return [t for t in tokenizer.get_vocab() if t not in special]


def _is_demo(vocab: dict[str, int]) -> bool:
    """Whether the vocabulary is the embedded demo's (keys ``k00..k31``, values ``v00..v31``)."""
    from lstmem_peft.utils.offline import NUM_KEYS, NUM_VALUES, demo_tokenizer

    return len(vocab) == 5 + NUM_KEYS + NUM_VALUES and vocab == demo_tokenizer().get_vocab()
