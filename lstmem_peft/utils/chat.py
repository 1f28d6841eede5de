"""How chat messages become tokens, one message at a time, and which of them fit a context window.

One definition for everything that turns a conversation into tokens: ``lstmem serve`` (its turn plan,
:mod:`lstmem_peft.serve.planning`) and the trainer's conversation episodes
(:func:`lstmem_peft.training.data.tokenize_conversation`), so an adapter is trained on exactly the
tokens the server writes and prompts with.
"""

from __future__ import annotations


class ChatFormat:
    """How chat messages become tokens, one message at a time.

    With a tokenizer that has a chat template, a message is the template applied to that message
    alone and the generation prompt is what ``add_generation_prompt=True`` adds. Without one (the
    embedded demo), a message is the BOS token (when the tokenizer has one) followed by the content,
    and the generation prompt is empty: the demo's own ``<s> k07 v19 ; ...`` / ``<s> ? k07`` format.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        self._generation_prompt: list[int] | None = None

    def encode_text(self, text: str) -> list[int]:
        """Plain text (memory writes, completions prompts): no special tokens added."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def message(self, role: str, content: str) -> list[int]:
        """Token ids of one message."""
        if self.templated:
            ids = self.tokenizer.apply_chat_template(
                [{"role": role, "content": content}], tokenize=True, add_generation_prompt=False
            )
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        bos = self.tokenizer.bos_token_id
        return ([bos] if bos is not None else []) + self.encode_text(content)

    def generation_prompt(self) -> list[int]:
        """The tokens that open the assistant's answer (empty without a chat template)."""
        if self._generation_prompt is None:
            if not self.templated:
                self._generation_prompt = []
            else:
                probe = [{"role": "user", "content": "x"}]
                bare = self.tokenizer.apply_chat_template(probe, tokenize=False)
                full = self.tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
                self._generation_prompt = self.encode_text(full[len(bare) :]) if full.startswith(bare) else []
        return self._generation_prompt


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
