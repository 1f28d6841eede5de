"""How chat messages become tokens (lstmem_peft/utils/chat.py): a prompt of whole messages is the chat
template applied to those messages, and what the template writes once per conversation (a default
system prompt, a BOS) is in each prompt once and in no message, so the server never writes it into
memory (issue 45: SmolLM2's 20-token default system prompt came before every message, assistant ones
included, when each message was templated alone)."""

from __future__ import annotations

import pytest
from real_models import needs_smollm2

from lstmem_peft.serve.planning import plan_chat
from lstmem_peft.serve.store import Session
from lstmem_peft.utils.chat import ChatFormat
from lstmem_peft.utils.offline import char_tokenizer

#: A template in the shape of SmolLM2's (written for this test): a default system message when the
#: conversation does not open with one, each message between role markers.
DEFAULT_SYSTEM = (
    "{% for m in messages %}"
    "{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nYou are a helpful bot.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: A BOS once, then headers (the shape of Llama 3's, without its date lines).
BOS_ONCE = (
    "{{ '<s>' }}{% for m in messages %}[{{ m['role'] }}]\n{{ m['content'] }}</t>{% endfor %}"
    "{% if add_generation_prompt %}[assistant]\n{% endif %}"
)
#: Roles must alternate user/assistant from a user message (the shape of Mistral's and Gemma's).
ALTERNATING = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant/user/...') }}{% endif %}"
    "<s>{{ m['role'][0] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}a: {% endif %}"
)
#: Refuses any conversation of more than one message: the message alone is all there is.
ONE_MESSAGE = (
    "{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
    "#{{ messages[0]['role'] }}: {{ messages[0]['content'] }}\n{% if add_generation_prompt %}#a: {% endif %}"
)

CONVERSATION = [
    {"role": "user", "content": "Ada keeps the key in the attic."},
    {"role": "assistant", "content": "Noted."},
    {"role": "user", "content": "Where is the key?"},
]


def tokenizer(template: str):
    tok = char_tokenizer()
    tok.chat_template = template
    return tok


def templated(tok, messages) -> list[int]:
    """The template applied to ``messages`` as a whole, with the generation prompt."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tok(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize(
    "template", [DEFAULT_SYSTEM, BOS_ONCE, ALTERNATING], ids=["system", "bos", "alternating"]
)
@pytest.mark.parametrize("first", [0, 1, 2])
def test_a_prompt_of_whole_messages_is_the_template_applied_to_them(template, first):
    tok = tokenizer(template)
    fmt = ChatFormat(tok)
    sent = CONVERSATION[first:]
    if template == ALTERNATING and sent[0]["role"] != "user":
        pytest.skip("this template refuses a conversation that opens with the assistant")
    laid = fmt.fit(sent, room=10_000)
    assert laid.first == 0
    assert laid.tokens == templated(tok, sent)


def test_the_default_system_prompt_is_in_each_prompt_once_and_in_no_message():
    tok = tokenizer(DEFAULT_SYSTEM)
    fmt = ChatFormat(tok)
    system = tok.decode(fmt.preamble())
    assert system == "<|im_start|>system\nYou are a helpful bot.<|im_end|>\n"
    for m in CONVERSATION:
        assert (
            tok.decode(fmt.message(m["role"], m["content"]))
            == f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
        )
    # a conversation that opens with its own system message gets no default one
    own = [{"role": "system", "content": "Be brief."}, *CONVERSATION]
    assert fmt.fit(own, room=10_000).tokens == templated(tok, own)
    assert "helpful bot" not in tok.decode(fmt.fit(own, room=10_000).tokens)


def test_the_window_keeps_the_latest_messages_with_the_preamble_and_the_generation_prompt_reserved():
    tok = tokenizer(DEFAULT_SYSTEM)
    fmt = ChatFormat(tok)
    extra = len(fmt.preamble()) + len(fmt.generation_prompt())
    sizes = [len(fmt.message(m["role"], m["content"])) for m in CONVERSATION]
    laid = fmt.fit(CONVERSATION, room=extra + sizes[-1])  # only the question fits
    assert laid.first == 2 and laid.tokens == templated(tok, CONVERSATION[2:])
    assert len(laid.tokens) == extra + sizes[-1]
    laid = fmt.fit(CONVERSATION, room=extra + sizes[-1] - 1)  # not even the question
    assert laid.first == 3 and laid.tokens == []


def test_the_server_writes_messages_without_the_default_system_prompt():
    """A chat turn whose older messages left the window: what is written into memory (before and after
    the answer) holds each message's own tokens, the prompt holds the system prompt once."""
    tok = tokenizer(DEFAULT_SYSTEM)
    fmt = ChatFormat(tok)
    session = Session(namespace="default", session="s")
    question = len(fmt.message("user", CONVERSATION[2]["content"]))
    window = len(fmt.preamble()) + len(fmt.generation_prompt()) + question + 8
    plan = plan_chat(fmt, session, CONVERSATION, window=window, max_tokens=8)
    assert plan.before == [t for m in CONVERSATION[:2] for t in fmt.message(m["role"], m["content"])]
    assert plan.after == fmt.message("user", CONVERSATION[2]["content"])
    assert "helpful bot" not in tok.decode(plan.before + plan.after)
    assert tok.decode(plan.prompt).count("helpful bot") == 1
    assert plan.prompt == templated(tok, CONVERSATION[2:])


def test_a_template_that_takes_one_message_renders_each_message_alone():
    tok = tokenizer(ONE_MESSAGE)
    fmt = ChatFormat(tok)
    assert tok.decode(fmt.message("user", "hi")) == "#user: hi\n"
    assert fmt.preamble() == []
    assert tok.decode(fmt.fit([{"role": "user", "content": "hi"}], room=100).tokens) == "#user: hi\n#a: "


def test_without_a_template_a_message_is_bos_and_content():
    tok = char_tokenizer()
    fmt = ChatFormat(tok)
    assert fmt.preamble() == [] and fmt.generation_prompt() == []
    assert (
        fmt.message("user", "k07") == [tok.bos_token_id] + tok("k07", add_special_tokens=False)["input_ids"]
    )


@pytest.mark.slow
@needs_smollm2
def test_the_real_smollm2_template_gives_whole_conversations_and_its_system_prompt_once():
    """On SmolLM2-135M-Instruct's own tokenizer (its BPE and its template): the prompt is exactly
    ``apply_chat_template`` of the messages in it, and a message carries no default system prompt."""
    from transformers import AutoTokenizer

    from lstmem_peft import resolve_backbone

    tok = AutoTokenizer.from_pretrained(resolve_backbone("smollm2-135m", progress=False))
    fmt = ChatFormat(tok)
    assert "You are a helpful AI assistant" in tok.decode(fmt.preamble())
    for first in range(len(CONVERSATION)):
        assert fmt.fit(CONVERSATION[first:], room=10_000).tokens == list(
            tok.apply_chat_template(CONVERSATION[first:], tokenize=True, add_generation_prompt=True)[
                "input_ids"
            ]
        )
    for m in CONVERSATION:
        assert "helpful AI assistant" not in tok.decode(fmt.message(m["role"], m["content"]))
