"""Sampling fields clients send (issue 48 item 7): OpenAI's ``logit_bias`` and vLLM's ``min_tokens`` and
``ignore_eos``, on chat and completions, with the default (library) engine.

Every answer's tokens equal the library's own ``model.generate(memory_cache=..., memory_write=False)``
from the same memory with the same settings: ``sequence_bias`` for ``logit_bias`` (transformers'
``SequenceBiasLogitsProcessor``), ``MinNewTokensLengthLogitsProcessor`` over the EOS tokens for
``min_tokens``, ``eos_token_id=None`` for ``ignore_eos``; greedy and seeded sampling. A stream says what
the body says; a turn that writes its answer writes exactly the answer the client got; stop strings
do not cut within the first ``min_tokens`` tokens; bad values are 400 errors that touch nothing. The
vLLM engine's arguments for the same fields: tests/test_vllm_args.py; its answers against this
engine's: tests/test_vllm.py.

The server runs in process (httpx's ASGI transport) on the embedded demo model.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve,test]'")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402
from test_serve import in_process  # noqa: E402  (the in-process client)
from test_serve_write_policy import assert_same_bits, library_write  # noqa: E402
from transformers import LogitsProcessorList  # noqa: E402
from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor  # noqa: E402

from lstmem_peft.serve import create_app  # noqa: E402
from lstmem_peft.serve.decoding import Sampling, find_stop  # noqa: E402
from lstmem_peft.utils.chat import ChatFormat  # noqa: E402

pytestmark = pytest.mark.timeout(300)

MODEL = "lstmem-demo"
HISTORY = "k07 v19 ; k12 v03 ; k01 v05 ; k02 v11 ; k30 v08"
SID = {"X-Session-Id": "fields"}
EOS, V05 = 2, 42  # the demo's </s>, and its token v05

#: (fields, greedy) per case: each alone, EOS pushed up so that min_tokens and ignore_eos decide the
#: length, one token pushed up and one ruled out, and sampling with a seed
CASES = [
    ({}, True),
    ({"min_tokens": 4}, True),
    ({"ignore_eos": True}, True),
    ({"logit_bias": {str(EOS): 100}}, True),
    ({"logit_bias": {str(EOS): 100}, "min_tokens": 3}, True),
    ({"logit_bias": {str(EOS): 100}, "min_tokens": 2, "ignore_eos": True}, True),
    ({"logit_bias": {str(V05): 100}}, True),
    ({"logit_bias": {str(V05): 2.5, "55": -100, str(EOS): 3}, "min_tokens": 2}, False),
    ({"logit_bias": {str(EOS): 4}, "ignore_eos": True, "min_tokens": 1}, False),
]


def library_tokens(
    loaded, memory, prompt: list[int], max_tokens: int, fields: dict, seed: int | None
) -> list:
    """The library's answer: ``generate`` from ``memory`` read-only with the fields as transformers'
    own settings and processors; cut after the first EOS unless ``ignore_eos`` (the EOS kept, as the
    server returns its tokens with their log-probabilities)."""
    kwargs = {"do_sample": False} if seed is None else {"do_sample": True, "top_k": 0, "temperature": 1.0}
    if fields.get("logit_bias"):
        kwargs["sequence_bias"] = [[[int(t)], float(b)] for t, b in fields["logit_bias"].items()]
    if fields.get("ignore_eos"):
        kwargs["eos_token_id"] = None
    if fields.get("min_tokens"):
        kwargs["logits_processor"] = LogitsProcessorList(
            [MinNewTokensLengthLogitsProcessor(len(prompt), fields["min_tokens"], [EOS])]
        )
    if seed is not None:
        torch.manual_seed(seed)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = loaded.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            memory_cache=memory.clone(),
            memory_write=False,
            max_new_tokens=max_tokens,
            pad_token_id=0,
            **kwargs,
        )
    tokens = out[0, len(prompt) :].tolist()
    if not fields.get("ignore_eos") and EOS in tokens:
        tokens = tokens[: tokens.index(EOS) + 1]
    return tokens


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_logit_bias_min_tokens_and_ignore_eos_equal_the_library_generate(loaded, tmp_path, route):
    """Each case on a session's memory (``lstmem_write`` none: every request reads the same memory):
    the tokens, text and ``finish_reason`` equal the library's ``generate`` with the same processors;
    the memory is left as it was."""
    app = create_app(loaded, str(tmp_path / "store"))
    tok, fmt = loaded.tokenizer, ChatFormat(loaded.tokenizer)
    max_tokens, seed = 6, 11

    def body(fields: dict, greedy: bool) -> dict:
        common = {"model": MODEL, "max_tokens": max_tokens, "lstmem_write": "none", **fields}
        common.update({"temperature": 0} if greedy else {"temperature": 1.0, "seed": seed})
        if route == "chat":
            return {**common, "messages": [{"role": "user", "content": "? k07"}], "logprobs": True}
        return {**common, "prompt": "? k07", "logprobs": 0}

    async def scenario(client):
        wrote = await client.post("/v1/memory/fields/write", json={"text": HISTORY}, headers=SID)
        assert wrote.status_code == 200, wrote.text
        before = app.state.scheduler.store.get("public", "fields").memory.clone()
        path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
        replies = []
        for fields, greedy in CASES:
            r = await client.post(path, json=body(fields, greedy), headers=SID)
            assert r.status_code == 200, (fields, r.text)
            replies.append(r.json())
        return before, replies

    before, replies = in_process(app, scenario)
    prompt = fmt.message("user", "? k07") if route == "chat" else fmt.encode_text("? k07")
    lengths = set()
    for (fields, greedy), reply in zip(CASES, replies, strict=True):
        expected = library_tokens(loaded, before, prompt, max_tokens, fields, None if greedy else seed)
        choice = reply["choices"][0]
        ended = bool(expected) and expected[-1] == EOS and not fields.get("ignore_eos")
        answer = expected[:-1] if ended else expected
        if route == "chat":  # chat's log-probabilities: the answer's tokens, not the EOS that ended it
            got = [t["token"] for t in choice["logprobs"]["content"]]
            text = choice["message"]["content"]
            want = [tok.decode([t]) for t in answer]
        else:  # completions': the EOS that ended it too
            got, text = choice["logprobs"]["tokens"], choice["text"]
            want = [tok.decode([t]) for t in expected]
        assert [g.strip() for g in got] == want, (fields, got, expected)
        assert text == tok.decode(answer, skip_special_tokens=True), fields
        assert choice["finish_reason"] == ("stop" if ended else "length"), fields
        assert reply["usage"]["completion_tokens"] == len(answer), fields
        if fields.get("min_tokens"):
            assert len(answer) >= fields["min_tokens"], fields
        if fields.get("ignore_eos"):
            assert len(answer) == max_tokens, fields
        lengths.add(len(answer))
    assert {0, 3, max_tokens} <= lengths  # EOS pushed up: none, min_tokens, ignore_eos decide
    assert_same_bits(app.state.scheduler.store.get("public", "fields").memory, before)


def test_a_stream_equals_the_body_and_a_written_answer_is_the_one_returned(loaded, tmp_path):
    """With ``ignore_eos`` and ``min_tokens``: a streamed answer's text equals the body's; a
    ``messages_and_answer`` turn writes the question and then exactly the answer it returned (as a
    client sends it back), bit for bit; and ``n`` sampled choices with a ``logit_bias`` batch as one
    decoding setting."""
    app = create_app(loaded, str(tmp_path / "store"))
    fmt = ChatFormat(loaded.tokenizer)
    fields = {"ignore_eos": True, "min_tokens": 2, "logit_bias": {str(EOS): 5}, "max_tokens": 5}
    question = [{"role": "user", "content": "? k12"}]
    base = {"model": MODEL, "messages": question, "temperature": 0, **fields}

    async def scenario(client):
        await client.post("/v1/memory/fields/write", json={"text": HISTORY}, headers=SID)
        plain = await client.post("/v1/chat/completions", json={**base, "lstmem_write": "none"}, headers=SID)
        text = ""
        async with client.stream(
            "POST", "/v1/chat/completions", json={**base, "stream": True, "lstmem_write": "none"}, headers=SID
        ) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        text += choice["delta"].get("content", "")
        before = app.state.scheduler.store.get("public", "fields").memory.clone()
        wrote = await client.post(
            "/v1/chat/completions", json={**base, "lstmem_write": "messages_and_answer"}, headers=SID
        )
        sampled = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "? k01", "n": 3, "seed": 5, "temperature": 1.0, **fields},
        )
        return plain.json(), text, before, wrote.json(), sampled.json()

    plain, streamed, before, wrote, sampled = in_process(app, scenario)
    answer = plain["choices"][0]["message"]["content"]
    assert streamed == answer and plain["choices"][0]["finish_reason"] == "length"
    assert wrote["choices"][0]["message"]["content"] == answer
    written = fmt.message("user", "? k12") + fmt.message("assistant", answer)
    assert wrote["lstmem"]["memory_tokens_written"] == len(written)
    assert_same_bits(
        app.state.scheduler.store.get("public", "fields").memory, library_write(loaded, before, written)
    )
    assert len(sampled["choices"]) == 3 and sampled["usage"]["completion_tokens"] == 3 * 5


def test_stop_strings_do_not_cut_within_the_first_min_tokens_tokens(loaded, tmp_path):
    """A prompt the demo continues to ``max_tokens``: a stop string found in its first word cuts the
    answer there without ``min_tokens``; with ``min_tokens`` past that word, the answer is cut at the
    first occurrence that ends later (or not at all), as vLLM looks for stop strings only after
    ``min_tokens`` tokens."""
    app = create_app(loaded, str(tmp_path / "store"))
    prompt = "<s> k07 v19 ; k01"
    base = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}

    async def scenario(client):
        full = (await client.post("/v1/completions", json={**base, "logprobs": 0})).json()["choices"][0]
        words = full["text"].split()
        stop = words[0]
        cut = (await client.post("/v1/completions", json={**base, "stop": [stop]})).json()["choices"][0]
        late = await client.post("/v1/completions", json={**base, "stop": [stop], "min_tokens": 2})
        streamed = ""
        async with client.stream(
            "POST", "/v1/completions", json={**base, "stop": [stop], "min_tokens": 2, "stream": True}
        ) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    streamed += "".join(c["text"] for c in json.loads(line[6:])["choices"])
        return full, stop, cut, late.json()["choices"][0], streamed

    full, stop, cut, late, streamed = in_process(app, scenario)
    assert full["finish_reason"] == "length" and cut["text"] == full["text"][: full["text"].index(stop)]
    tok = loaded.tokenizer
    ids = tok.convert_tokens_to_ids([piece.strip() for piece in full["logprobs"]["tokens"]])
    head = len(tok.decode(ids[:2], skip_special_tokens=True))  # the text of the first min_tokens tokens
    at = find_stop(full["text"], (stop,), head)
    assert late["text"] == (full["text"] if at < 0 else full["text"][:at]) and late["text"] != cut["text"]
    assert streamed == late["text"]


def test_sampling_fields_enter_the_batch_key_and_the_generate_arguments():
    """Requests batch only when their fields agree; the library's ``generate`` gets ``sequence_bias``
    and ``eos_token_id=None`` (``min_tokens`` is the engine's processor: it needs the prompt width)."""
    plain = Sampling(4, 0.0, 1.0, 1, (), None)
    biased = Sampling(4, 0.0, 1.0, 1, (), None, logit_bias=((5, 1.0),))
    assert (
        len(
            {
                plain.batch_key(),
                biased.batch_key(),
                Sampling(4, 0.0, 1.0, 1, (), None, min_tokens=2).batch_key(),
            }
        )
        == 3
    )
    assert Sampling(4, 0.0, 1.0, 1, (), None, ignore_eos=True).batch_key() != plain.batch_key()
    kwargs = Sampling(
        4, 0.5, 0.9, 2, (), 3, logit_bias=((5, 1), (9, -100.0)), ignore_eos=True
    ).generate_kwargs()
    assert kwargs["sequence_bias"] == [[[5], 1.0], [[9], -100.0]] and kwargs["eos_token_id"] is None
    assert "sequence_bias" not in plain.generate_kwargs() and "eos_token_id" not in plain.generate_kwargs()
    assert find_stop("ab ab", ("ab",)) == 0 and find_stop("ab ab", ("ab",), after=2) == 3
    assert find_stop("ab ab", ("ab",), after=1) == 0 and find_stop("ab", ("ab",), after=2) == -1


def test_bad_sampling_fields_are_400_errors_that_touch_nothing(loaded, tmp_path):
    """``logit_bias`` keys that are not token ids of the vocabulary, biases out of [-100, 100], more
    than 1024 tokens; ``min_tokens`` negative or over ``max_tokens``; ``ignore_eos`` not a boolean: 400
    naming the parameter, on both endpoints, and the session's memory is as it was."""
    app = create_app(loaded, str(tmp_path / "store"))
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "? k07"}], "max_tokens": 3}
    completion = {"model": MODEL, "prompt": "? k07", "max_tokens": 3}
    bad = [
        ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"-1": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"1.5": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"69": 1}}, "logit_bias", "69 tokens, ids 0 to 68"),
        ({"logit_bias": {"5": 100.5}}, "logit_bias", "-100 to 100"),
        ({"logit_bias": {"5": -101}}, "logit_bias", "-100 to 100"),
        ({"logit_bias": {"5": "much"}}, "logit_bias", ""),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "at most 1024"),
        ({"min_tokens": -1}, "min_tokens", ""),
        ({"min_tokens": 4}, "min_tokens", "more than max_tokens 3"),
        ({"ignore_eos": [True]}, "ignore_eos", ""),
    ]

    async def scenario(client):
        await client.post("/v1/memory/fields/write", json={"text": HISTORY}, headers=SID)
        before = (await client.get("/v1/memory/fields")).json()
        errors = []
        for fields, _, _ in bad:
            for path, base in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
                r = await client.post(path, json={**base, **fields}, headers=SID)
                errors.append((r.status_code, r.json()["error"]))
        scoring = {**completion, "max_tokens": 0, "echo": True, "min_tokens": 1}
        r = await client.post("/v1/completions", json=scoring, headers=SID)
        errors.append((r.status_code, r.json()["error"]))
        ok = await client.post("/v1/chat/completions", json={**chat, "logit_bias": {"68": -100.0, "0": 100}})
        after = (await client.get("/v1/memory/fields")).json()
        return before, errors, ok, after

    before, errors, ok, after = in_process(app, scenario)
    expected = [(param, words) for _, param, words in bad for _ in range(2)] + [
        ("min_tokens", "max_tokens 0")
    ]
    for (status, error), (param, words) in zip(errors, expected, strict=True):
        assert status == 400 and error["param"] == param and words in error["message"], error
    assert ok.status_code == 200, ok.text  # the edges of the range and of the vocabulary
    assert (after["commit"], after["tokens_written"]) == (before["commit"], before["tokens_written"])
