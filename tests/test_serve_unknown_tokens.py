"""Nothing typed is accepted silently (issue 48 item 2): text the served model's tokenizer cannot
represent is refused, not answered and written as its unknown token.

The embedded demo's word-level tokenizer reads every word it has no token for as ``<pad>``: an
English sentence sent as it is would get a 200 with empty content and leave pads in the session's
memory. Every text a request brings (chat messages, completions prompts, memory writes) is refused
instead with a 400 ``unknown_tokens`` that names the unknown words and the model's vocabulary (its
size, what kind of text it reads and, for a small one, its tokens): the session's memory file and
record are as they were, bit for bit. The unknown token typed as itself (``<pad>``) is a token like
any other; token-id prompts are taken as they are, within the ids the model embeds. The page shows the
server's message where the answer would have been (the page's own script, run by node on the real
refusal's body).
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve,test]'")
httpx = pytest.importorskip("httpx")

from test_serve import in_process  # noqa: E402  (the in-process client)
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from lstmem_peft.serve import create_app  # noqa: E402
from lstmem_peft.serve.vocabulary import Vocabulary, fold  # noqa: E402
from lstmem_peft.utils.offline import char_tokenizer  # noqa: E402

pytestmark = pytest.mark.timeout(300)

MODEL = "lstmem-demo"
HISTORY = "k07 v19 ; k12 v03 ; k01 v05"
SID = {"X-Session-Id": "typed"}
#: 17 demo tokens, every one of them <pad>: what the issue saw answered with a 200 and empty content
ENGLISH = "Please tell me which value the key seven was given in the history I wrote earlier today"


def assert_names_the_vocabulary(error: dict, param: str, words: list[str]) -> None:
    """A refusal of unknown text: 400 ``unknown_tokens`` naming the parameter, the unknown words, the
    demo's vocabulary (its size, its kind, its tokens) and that nothing was written."""
    assert error["code"] == "unknown_tokens" and error["param"] == param, error
    message = error["message"]
    for word in words:
        assert json.dumps(word, ensure_ascii=False) in message, (word, message)
    for part in ("69 tokens", "word-level", "<pad> <s> </s> ; ? k00..k31 v00..v31", "? k07", "nothing was"):
        assert part in message, (part, message)


def test_unknown_words_are_refused_naming_the_vocabulary_and_nothing_is_written(loaded, tmp_path):
    """English to the demo on every route that takes text: chat (also streamed, and one unknown word
    in an older message), completions (one prompt, and the second of a list), memory writes (text and
    messages): each a 400 naming the words and the vocabulary; the session's memory file (its bytes)
    and its record are as before, and no session appears for a request that named a new one."""
    app = create_app(loaded, str(tmp_path / "store"))
    chat = {"model": MODEL, "max_tokens": 2, "temperature": 0}

    def user(text: str) -> dict:
        return {"role": "user", "content": text}

    refused = [
        ("/v1/chat/completions", {**chat, "messages": [user(ENGLISH)]}, "messages", ["Please", "earlier"]),
        ("/v1/chat/completions", {**chat, "messages": [user(ENGLISH)], "stream": True}, "messages", ["tell"]),
        (
            "/v1/chat/completions",
            {
                **chat,
                "messages": [user("k07 v19 ; hello"), {"role": "assistant", "content": "v19"}, user("? k07")],
            },
            "messages",
            ["hello"],
        ),
        ("/v1/chat/completions", {**chat, "messages": [user("? k07?")]}, "messages", ["k07?"]),
        ("/v1/completions", {**chat, "prompt": ENGLISH}, "prompt", ["Please"]),
        ("/v1/completions", {**chat, "prompt": ["? k07", "? key"]}, "prompt", ["key"]),
        ("/v1/completions", {**chat, "prompt": ENGLISH, "max_tokens": 0, "echo": True}, "prompt", ["which"]),
        ("/v1/memory/typed/write", {"text": "k07 v19 ; my cat is Tom"}, "text", ["my", "cat", "Tom"]),
        ("/v1/memory/typed/write", {"messages": [user("k01 v02 ; café")]}, "messages", ["café"]),
    ]

    async def scenario(client):
        wrote = await client.post("/v1/memory/typed/write", json={"text": HISTORY}, headers=SID)
        assert wrote.status_code == 200, wrote.text
        before = (await client.get("/v1/memory/typed/export", headers=SID)).content
        record = (await client.get("/v1/memory/typed")).json()
        errors = []
        for path, body, _, _ in refused:
            headers = SID if "prompt" not in body or isinstance(body["prompt"], str) else {}
            r = await client.post(path, json=body, headers=headers)
            errors.append((r.status_code, r.json()["error"]))
        new = await client.post(
            "/v1/chat/completions",
            json={**chat, "messages": [user(ENGLISH)]},
            headers={"X-Session-Id": "new"},
        )
        after = (await client.get("/v1/memory/typed/export", headers=SID)).content
        sessions = (await client.get("/v1/sessions")).json()["data"]
        return before, record, errors, new, after, (await client.get("/v1/memory/typed")).json(), sessions

    before, record, errors, new, after, record_after, sessions = in_process(app, scenario)
    for (status, error), (_, _, param, words) in zip(errors, refused, strict=True):
        assert status == 400, error
        assert_names_the_vocabulary(error, param, words)
    english = errors[0][1]["message"]
    assert english.startswith(
        "messages[0].content: the vocabulary of lstmem-demo has no token for 17 of its words"
    )
    assert "messages[0].content" in errors[2][1]["message"] and errors[5][1]["message"].startswith(
        "prompt 1:"
    )
    assert new.status_code == 400
    assert after == before  # the memory file, byte for byte
    assert (record_after["commit"], record_after["tokens_written"], record_after["turns"]) == (
        record["commit"],
        record["tokens_written"],
        record["turns"],
    )
    assert [s["id"] for s in sessions] == ["typed"]


def test_the_unknown_token_typed_as_itself_and_token_id_prompts_are_taken(loaded, tmp_path):
    """``<pad>`` typed as itself is the token the client meant (200); token-id prompts are used as
    they are, the pad's id included, and an id the model does not embed is a 400 naming the
    vocabulary."""
    app = create_app(loaded, str(tmp_path / "store"))
    base = {"model": MODEL, "max_tokens": 2, "temperature": 0}

    async def scenario(client):
        typed = await client.post("/v1/completions", json={**base, "prompt": "<s> k07 v19 ; <pad> ? k07"})
        ids = await client.post("/v1/completions", json={**base, "prompt": [1, 12, 0, 4, 12]})
        outside = await client.post("/v1/completions", json={**base, "prompt": [[1, 12], [4, 69]]})
        return typed, ids, outside

    typed, ids, outside = in_process(app, scenario)
    assert typed.status_code == 200 and ids.status_code == 200, (typed.text, ids.text)
    error = outside.json()["error"]
    assert outside.status_code == 400 and error["param"] == "prompt"
    assert "prompt 1 has token id 69" in error["message"] and "69 tokens, ids 0 to 68" in error["message"]
    assert "k00..k31 v00..v31" in error["message"]


def test_vocabularies_are_described_and_checked_by_what_their_tokenizer_reads():
    """The check and the description of tokenizers other than the demo's: a character-level one
    (its unknown token is its pad too) refuses the characters it lacks, named as characters; a
    WordPiece one refuses what becomes ``[UNK]`` and takes ``[UNK]`` typed as itself; a BPE one with
    no unknown token reads everything and is never checked. Runs of tokens are folded."""
    chars = Vocabulary(char_tokenizer(), 99, "tiny")
    assert chars.unknown_ids == {0} and chars.unknown_words("héllo, wörld") == ["é", "ö"]
    assert "of its characters" in chars.refusal("prompt", ["é"])
    assert "99 tokens, character-level" in chars.description and "0..9 a..z A..Z" in chars.description

    vocab = {"[UNK]": 0, "[PAD]": 1, "the": 2, "cat": 3, "##s": 4}
    piece = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    piece.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece = Vocabulary(
        PreTrainedTokenizerFast(tokenizer_object=piece, unk_token="[UNK]", pad_token="[PAD]"), 5, "wp"
    )
    assert wordpiece.unknown_words("the cats [UNK] dog") == ["dog"]
    assert "WordPiece" in wordpiece.description

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # every byte is a token: nothing is unknown
    byte_level = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe = Vocabulary(PreTrainedTokenizerFast(tokenizer_object=byte_level), 256, "bpe")
    assert bpe.unknown_ids == frozenset() and bpe.unknown_words("anything, ünïcode 🙂") == []
    bpe.check_texts([("prompt", "zzz")], "prompt")  # nothing to check: no unknown token
    assert "256 tokens, BPE." in bpe.description

    assert fold(["<pad>", "k00", "k01", "k02", "v07", "a", "b", "c", "x", "y", " "]) == [
        "<pad>",
        "k00..k02",
        "v07",
        "a..c",
        "x",
        "y",
        '" "',
    ]


#: The page's script in node, with the browser's objects it uses stubbed: ``fetch`` answers the
#: question with the server's real refusal (``REFUSAL``), every other route with an empty success.
PAGE_HARNESS = r"""
const vm = require('vm');
const [script, refusal] = [process.argv[1], JSON.parse(process.argv[2])];  // node -e CODE SCRIPT BODY
const elements = {};
const values = {dq: 'What is k07', dsid: 'typed'};
const element = id => elements[id] = elements[id] || {id, value: values[id] || '',
  textContent: '', innerHTML: '', rows: [], classList: {toggle() {}}, dataset: {}, appendChild() {},
  tBodies: [{insertAdjacentHTML(where, html) { elements.dtable.rows.push(html); }}]};
const json = (status, body) => ({ok: status < 400, status, statusText: '', json: async () => body});
const context = {
  console, URLSearchParams, JSON, Math, String, Object, Array, Error,
  location: {search: ''}, localStorage: {getItem: () => null, setItem() {}},
  document: {getElementById: element, querySelectorAll: () => [], createElement: () => element('new')},
  fetch: async (url) => url === '/v1/chat/completions' ? json(400, refusal)
    : url === '/v1/models' ? json(200, {data: [{id: 'lstmem-demo'}]}) : json(200, {data: []}),
};
vm.createContext(context);
vm.runInContext(script, context);
(async () => {
  await new Promise(r => setTimeout(r, 50));
  await vm.runInContext("demoAsk($('dq').value.trim())", context);
  console.log(JSON.stringify({error: element('derror').textContent, rows: element('dtable').rows.length}));
})();
"""


def test_the_page_shows_the_servers_refusal_instead_of_an_answer(loaded, tmp_path):
    """An English question asked on the page's demo: the page shows ``error 400:`` and the server's
    own message (the words, the vocabulary) in its alert line and adds no answer row."""
    from lstmem_peft.serve.page import PAGE

    assert 'id="derror"' in PAGE and "j.error.message" in PAGE
    node = shutil.which("node")
    if node is None:
        pytest.skip("no node on PATH to run the page's script")
    app = create_app(loaded, str(tmp_path / "store"))

    async def scenario(client):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "What is k07"}], "max_tokens": 1}
        return (await client.post("/v1/chat/completions", json=body, headers=SID)).json()

    refusal = in_process(app, scenario)
    script = PAGE.split("<script>")[1].split("</script>")[0]
    done = subprocess.run(
        [node, "-e", PAGE_HARNESS, script, json.dumps(refusal)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    shown = json.loads(done.stdout.strip().splitlines()[-1])
    assert shown == {"error": "error 400: " + refusal["error"]["message"], "rows": 0}
    assert '"What", "is"' in shown["error"] and "69 tokens" in shown["error"]
