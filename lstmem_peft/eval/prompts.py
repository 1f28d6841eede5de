"""The text a model reads in an evaluation: a history and its questions in the model's chat template.

:class:`PromptBuilder` turns a :class:`~lstmem_peft.eval.protocol.History` into token ids that are
written once (into memory and the KV cache) and each :class:`~lstmem_peft.eval.protocol.Question`
into the ids that follow them, so that history + question reads exactly as one user turn.
"""

from __future__ import annotations

from .protocol import History, Question


class PromptBuilder:
    """Token ids of a history and of each question, in one user turn of the model's chat template.

    The model reads ``template(history.text + question.prompt)``. The template's opening and the
    history form the shared prefix (written into memory and the KV cache once per history); the
    question and the template's closing (the assistant cue) are the per-question part.

    Args:
        tokenizer: the model's tokenizer.
        chat_template: wrap the prompt in the tokenizer's chat template; default: when it has one.
        template_kwargs: extra arguments of ``apply_chat_template`` (e.g. ``{"enable_thinking": False}``).
    """

    def __init__(
        self, tokenizer, chat_template: bool | None = None, template_kwargs: dict | None = None
    ) -> None:
        has_template = getattr(tokenizer, "chat_template", None) is not None
        if chat_template and not has_template:
            raise ValueError(
                "chat_template=True but the tokenizer has no chat template; pass chat_template=False"
            )
        self.tokenizer = tokenizer
        self.chat_template = has_template if chat_template is None else chat_template
        self.template_kwargs = dict(template_kwargs or {})

    def _render(self, content: str, system: str | None = None) -> str:
        messages = [{"role": "user", "content": content}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        return self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=True,
            **self.template_kwargs,
        )

    def _ids(self, text: str, special: bool) -> list[int]:
        return self.tokenizer(text, add_special_tokens=special)["input_ids"] if text else []

    def _segments(self, history: History) -> list[str]:
        segments = history.segments or [history.text]
        if "".join(segments) != history.text:
            raise ValueError(f"history {history.id!r}: its segments do not add up to its text")
        return segments

    def history_ids(self, history: History, in_prompt: bool = True) -> list[list[int]]:
        """Token ids of the history's segments (the first with the template's opening when ``in_prompt``)."""
        segments = self._segments(history)
        if in_prompt and self.chat_template:
            # a non-space character after the history, as templates that trim the message would
            # otherwise eat the history's trailing whitespace
            full = self._render(history.text + "?", history.system)
            start = full.find(history.text)
            if start < 0:
                raise ValueError(
                    "the chat template changes the history text, so the history cannot be cached as a prompt "
                    "prefix; evaluate with chat_template=False (CLI: --no-chat-template)"
                )
            segments = [full[:start] + segments[0]] + segments[1:]
            return [self._ids(s, special=False) for s in segments]
        if in_prompt and history.system is not None:  # no chat template: the system text opens the prompt
            segments = [history.system + "\n\n" + segments[0]] + segments[1:]
        return [self._ids(s, special=i == 0) for i, s in enumerate(segments)]

    def question_ids(self, history: History, question: Question, in_prompt: bool = True) -> list[int]:
        """Token ids that follow the history (``in_prompt``), or the question as a prompt of its own."""
        if not in_prompt:
            if self.chat_template:
                return self._ids(self._render(question.prompt.lstrip(), history.system), special=False)
            opening = "" if history.system is None else history.system + "\n\n"
            return self._ids(opening + question.prompt.lstrip(), special=True)
        if not self.chat_template:
            return self._ids(question.prompt, special=False)
        full = self._render(history.text + question.prompt, history.system)
        start = full.find(history.text)
        if start < 0:
            raise ValueError("the chat template changes the prompt text; evaluate with chat_template=False")
        return self._ids(full[start + len(history.text) :], special=False)
