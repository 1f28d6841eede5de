"""How chat messages become tokens, one message at a time, and which of them fit a context window.

One definition for everything that turns a conversation into tokens: ``lstmem serve`` (its turn plan,
:mod:`lstmem_peft.serve.planning`) and the trainer's conversation episodes
(:func:`lstmem_peft.training.data.tokenize_conversation`), so an adapter is trained on exactly the
tokens the server writes and prompts with.
"""

from __future__ import annotations

from dataclasses import dataclass


class ChatFormat:
    """How chat messages become tokens, one message at a time.

    With a tokenizer that has a chat template, a message's tokens are what the template writes for
    that message inside a conversation, and what it writes once at the start of a conversation (a
    default system prompt, a BOS token: :meth:`preamble`) goes once at the start of each prompt
    (:meth:`fit`), never before every message. So a prompt of whole messages is the template applied
    to those messages: SmolLM2's template, applied to each message alone, would repeat its
    20-token default system prompt before every message, assistant ones included, and write it into
    memory with each of them.

    A message's own tokens are found by rendering it after a short conversation that the template
    accepts (a user and an assistant message before a user message; a user message before an
    assistant one) and keeping what it adds. Where that does not work (the template refuses the
    conversation or re-renders earlier messages, or the role is neither ``user`` nor
    ``assistant``: a system message, usually the first, is its own start), the message is the
    template applied to it alone, as before. The generation prompt is what
    ``add_generation_prompt=True`` adds.

    Without a template (the embedded demo), a message is the BOS token (when the tokenizer has one)
    followed by the content, the preamble and the generation prompt are empty: the demo's own
    ``<s> k07 v19 ; ...`` / ``<s> ? k07`` format.
    """

    #: The conversations a message is rendered after, by role: each valid for templates that want
    #: roles to alternate, starting with a user message (Mistral, Gemma).
    _BEFORE = {
        "user": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
        "assistant": [{"role": "user", "content": "x"}],
    }

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        self._generation_prompt: list[int] | None = None
        self._preamble: list[int] | None = None

    def encode_text(self, text: str) -> list[int]:
        """Plain text (memory writes, completions prompts): no special tokens added."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def message(self, role: str, content: str) -> list[int]:
        """Token ids of one message, without what the template writes once per conversation
        (:meth:`preamble`)."""
        if self.templated:
            return self.encode_text(self._own_text(role, content))
        bos = self.tokenizer.bos_token_id
        return ([bos] if bos is not None else []) + self.encode_text(content)

    def preamble(self, first_role: str = "user") -> list[int]:
        """The tokens a prompt starts with, before its first message, when that message's role is
        ``first_role``: what the template writes once per conversation (SmolLM2: its default system
        prompt; Llama 3: BOS and a system header). Empty without a template, and before a system
        message, which the template renders whole (:meth:`message`)."""
        if not self.templated or first_role == "system":
            return []
        if self._preamble is None:
            alone = self._render([{"role": "user", "content": "x"}])
            own = self._own_text("user", "x")
            self._preamble = (
                self.encode_text(alone[: -len(own)]) if alone.endswith(own) and own != alone else []
            )
        return self._preamble

    def generation_prompt(self) -> list[int]:
        """The tokens that open the assistant's answer (empty without a chat template)."""
        if self._generation_prompt is None:
            if not self.templated:
                self._generation_prompt = []
            else:
                probe = [{"role": "user", "content": "x"}]
                bare = self._render(probe)
                full = self._render(probe, add_generation_prompt=True)
                self._generation_prompt = self.encode_text(full[len(bare) :]) if full.startswith(bare) else []
        return self._generation_prompt

    def fit(self, messages: list[dict], room: int) -> ChatPrompt:
        """The prompt of the latest ``messages`` (``{"role", "content"}`` dicts) that fit ``room``
        tokens together with the preamble and the generation prompt (:func:`prompt_start`).

        Args:
            messages: the conversation, oldest first.
            room: the tokens the whole prompt may take (a context window less the answer's tokens).
        Returns:
            :class:`ChatPrompt`: every message's tokens, the first message in the prompt
            (``len(messages)`` when not even the latest fits) and the prompt's tokens.
        """
        encoded = [self.message(m["role"], m["content"]) for m in messages]
        opening = self.generation_prompt()
        reserved = len(opening) + len(self.preamble())  # the longest preamble: a user message's
        first = prompt_start(encoded, room - reserved)
        if first == len(encoded):
            return ChatPrompt(encoded, first, [], room - reserved)
        head = self.preamble(messages[first]["role"])
        return ChatPrompt(
            encoded, first, head + [t for ids in encoded[first:] for t in ids] + opening, room - reserved
        )

    def _render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _own_text(self, role: str, content: str) -> str:
        """What the template writes for one message inside a conversation (the class docstring)."""
        message = {"role": role, "content": content}
        before = self._BEFORE.get(role)
        if before is not None:
            try:
                head, whole = self._render(before), self._render([*before, message])
            except Exception:  # noqa: BLE001 - a template that refuses the probe: render the message alone
                head = whole = None
            if whole is not None and whole.startswith(head) and len(whole) > len(head):
                return whole[len(head) :]
        return self._render([message])


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation laid out for one prompt (:meth:`ChatFormat.fit`).

    Attributes:
        encoded: each message's own tokens (:meth:`ChatFormat.message`).
        first: the index of the first message in the prompt; ``len(encoded)`` when not even the
            latest message fits (``tokens`` is then empty).
        tokens: the prompt: the preamble, the messages from ``first`` on, the generation prompt.
        budget: the tokens the messages could take (the room less the preamble and the generation
            prompt); at most 0 when those alone fill it.
    """

    encoded: list[list[int]]
    first: int
    tokens: list[int]
    budget: int


def prompt_start(encoded: list[list[int]], budget: int) -> int:
    """Index of the first message in the prompt: the latest messages (token lists, in order) whose
    tokens together fit ``budget``. ``len(encoded)`` when not even the latest fits."""
    used, first = 0, len(encoded)
    for ids in reversed(encoded):
        if used + len(ids) > budget:
            break
        used += len(ids)
        first -= 1
    return first
