"""The exactness contract of ``generate`` with LSTMem memory, mode by mode (lstmem_peft.tuner.generation).

(a) each generated token's logits equal the last-position logits of one forward over prompt + tokens
    so far from the starting memory; (b) afterwards each row's memory equals the starting memory fed
    exactly the tokens generate kept for that row. The oracle is recomputation with plain forwards.

The model runs in float64 with float32 states, so paths that order the arithmetic differently (the
block scan, the one-token step) agree to float32 rounding of the states: about 2^-24 relative per
step, a few hundred steps at most here, hence 1e-5.
"""

import threading
import time

import pytest
import torch
from oracle import PAD, assert_same_memory, check_contract, expand, expected_memory, states
from peft import get_peft_model
from tiny_models import VOCAB, randomize_memory, tiny_model
from transformers import DynamicCache, StaticCache
from transformers.generation.streamers import BaseStreamer

from lstmem_peft import LSTMemConfig, MemoryCache, write_history

TOL = dict(atol=1e-5, rtol=1e-5)


def make(seed=0, **config):
    model = get_peft_model(tiny_model("qwen3", seed).double(), LSTMemConfig(**config))
    randomize_memory(model, seed=seed + 1)
    return model.eval()


@pytest.fixture(scope="module")
def model():
    return make()


def prompt_batch(lengths=(7, 4), seed=0):
    """Left-padded prompts (no EOS/pad inside) and their mask."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.full((len(lengths), T), PAD, dtype=torch.long)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, T - n :] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[i, T - n :] = 1
    return ids, mask


def history_cache(model, rows, seed=3):
    cache = MemoryCache()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        write_history(
            model, torch.randint(3, VOCAB, (rows, 20), generator=g), cache, block_size=8, progress=False
        )
    return cache


def generate(model, prompt, mask, cache, **kwargs):
    kwargs = (
        dict(max_new_tokens=6, return_dict_in_generate=True, output_logits=True, pad_token_id=PAD) | kwargs
    )
    with torch.no_grad():
        return model.generate(input_ids=prompt, attention_mask=mask, memory_cache=cache, **kwargs)


def check(model, start, prompt, mask, out, cache, **kwargs):
    check_contract(model, start, prompt, mask, out, cache, **kwargs, **TOL)


# ---------------------------------------------------------------------- modes that must be exact
EXACT_MODES = {
    "greedy": dict(do_sample=False),
    "sampling": dict(do_sample=True, top_k=20, temperature=0.8),
    "num_return_sequences": dict(do_sample=True, num_return_sequences=3),
    "use_cache=False": dict(do_sample=False, use_cache=False),
    "static cache": dict(do_sample=False, cache_implementation="static"),
    "prefill chunks": dict(do_sample=False, prefill_chunk_size=3),
    "max_length": dict(do_sample=False, max_new_tokens=None, max_length=11),
}


@pytest.mark.parametrize("mode", sorted(EXACT_MODES))
def test_generate_is_exact(model, mode):
    kwargs = dict(EXACT_MODES[mode])
    prompt, mask = prompt_batch()
    start = history_cache(model, 2)
    cache = start.clone()
    torch.manual_seed(0)
    out = generate(model, prompt, mask, cache, **kwargs)
    check(model, start, prompt, mask, out, cache, repeats=kwargs.get("num_return_sequences", 1))


@pytest.mark.parametrize("seed", range(4))
def test_num_return_sequences_from_padded_prompts_and_histories_of_their_own(model, seed):
    """Two prompts (the second left-padded), each with its own history row (of different lengths),
    sampling with ``num_return_sequences=3`` and end tokens that finish rows at different steps: every
    returned row follows the contract (its own prompt's and history's memory, nothing past its end)."""
    from lstmem_peft import MemoryCache

    g = torch.Generator().manual_seed(seed)
    prompt, mask = prompt_batch((7, 4 + seed % 3), seed=seed)
    history = torch.randint(3, VOCAB, (2, 20), generator=g)
    history_mask = torch.ones_like(history)
    history_mask[1, : 3 + seed] = 0
    start = MemoryCache()
    with torch.no_grad():
        write_history(model, history, start, attention_mask=history_mask, block_size=8, progress=False)
    cache = start.clone()
    torch.manual_seed(seed)
    ends = [3, 4, 5, 6, 7, 8]  # several end tokens: rows stop early, each at its own step
    out = generate(
        model,
        prompt,
        mask,
        cache,
        do_sample=True,
        num_return_sequences=3,
        max_new_tokens=8,
        eos_token_id=ends,
    )
    generated = out.sequences[:, prompt.shape[1] :]
    stops = [next((j for j, t in enumerate(row) if t in ends), None) for row in generated.tolist()]
    kept = torch.tensor([len(generated[0]) - 1 if j is None else j for j in stops])
    expected = expected_memory(
        model, expand(start, 3), prompt.repeat_interleave(3, 0), mask.repeat_interleave(3, 0), generated, kept
    )
    assert_same_memory(cache, expected, **TOL)


@pytest.fixture(scope="module")
def sliding():
    """A Mistral whose attention sees only the last 4 positions: its KV caches keep a window."""
    from tiny_models import COMMON
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    base = MistralForCausalLM(MistralConfig(**{**COMMON, "sliding_window": 4})).double()
    model = get_peft_model(base, LSTMemConfig())
    randomize_memory(model, seed=1)
    return model.eval()


@pytest.mark.parametrize("mode", ["dynamic", "static", "use_cache=False"])
def test_sliding_window_caches(sliding, mode):
    """Prompts and generations longer than the window: memory keeps what the window drops."""
    kwargs = {"static": dict(cache_implementation="static"), "use_cache=False": dict(use_cache=False)}
    prompt, mask = prompt_batch()
    start = history_cache(sliding, 2)
    cache = start.clone()
    out = generate(sliding, prompt, mask, cache, do_sample=False, max_new_tokens=8, **kwargs.get(mode, {}))
    check(sliding, start, prompt, mask, out, cache)


def test_static_cache_without_padding_and_a_static_cache_object(model):
    prompt, _ = prompt_batch((6, 6))
    mask = torch.ones_like(prompt)
    for kwargs in (
        dict(cache_implementation="static"),
        dict(past_key_values=StaticCache(config=model.config, max_cache_len=32)),
    ):
        start = history_cache(model, 2)
        cache = start.clone()
        out = generate(model, prompt, mask, cache, do_sample=False, **kwargs)
        check(model, start, prompt, mask, out, cache)


def _eos_that_stops_row_0_early(model, prompt, mask, start):
    """A token that row 0 generates at step 2 and row 1 never generates in the first 6 steps."""
    out = generate(model, prompt, mask, start.clone(), do_sample=False, eos_token_id=None)
    gen = out.sequences[:, prompt.shape[1] :]
    for step in range(1, 4):
        token = int(gen[0, step])
        if token not in gen[1].tolist() and token not in gen[0, :step].tolist() and token not in (PAD,):
            return token
    pytest.skip("no token separates the rows for this seed")


def test_a_row_that_finishes_early_stops_writing(model):
    prompt, mask = prompt_batch()
    start = history_cache(model, 2)
    eos = _eos_that_stops_row_0_early(model, prompt, mask, start)
    cache = start.clone()
    out = generate(model, prompt, mask, cache, do_sample=False, eos_token_id=eos)
    gen = out.sequences[:, prompt.shape[1] :]
    assert eos in gen[0].tolist() and (gen[0] == PAD).any()  # row 0 finished, then got padding
    check(model, start, prompt, mask, out, cache, stop_token=eos)


def test_stop_strings_end_rows_and_their_memory():
    from lstmem_peft.utils.offline import char_tokenizer, tiny_qwen3

    tok = char_tokenizer()
    base = tiny_qwen3(vocab_size=len(tok), hidden_size=48, seed=4).double()
    model = get_peft_model(base, LSTMemConfig()).eval()
    randomize_memory(model, seed=5)
    prompt = tok(["abcab", "xyz"], return_tensors="pt", padding=True)
    start = MemoryCache()
    free = generate(
        model, prompt.input_ids, prompt.attention_mask, start.clone(), do_sample=False, eos_token_id=None
    )
    text = tok.decode(free.sequences[0, prompt.input_ids.shape[1] + 2])  # row 0's third character
    cache = start.clone()
    out = generate(
        model,
        prompt.input_ids,
        prompt.attention_mask,
        cache,
        do_sample=False,
        eos_token_id=None,
        stop_strings=[text],
        tokenizer=tok,
    )
    stop_token = tok.convert_tokens_to_ids(text)
    check(model, start, prompt.input_ids, prompt.attention_mask, out, cache, stop_token=stop_token)


def test_beam_search_reorders_memory_and_returns_the_hypotheses_memory(model):
    """(a) beams with a KV cache (memory reordered every step) pick exactly what beams without a
    cache pick (every step recomputed from the starting memory); (b) the cache holds the memory of
    each returned hypothesis."""
    prompt, mask = prompt_batch()
    start = history_cache(model, 2)
    kw = dict(num_beams=3, num_return_sequences=2, do_sample=False, output_scores=True, max_new_tokens=5)
    cached, plain = start.clone(), start.clone()
    out = generate(model, prompt, mask, cached, **kw)
    ref = generate(model, prompt, mask, plain, use_cache=False, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, **TOL)
    assert cached.batch_size == 4
    generated = out.sequences[:, prompt.shape[1] :]
    real = (generated != PAD).long() * torch.arange(1, generated.shape[1] + 1)
    kept = real.amax(1) - 1
    expected = expected_memory(
        model, expand(start, 2), prompt.repeat_interleave(2, 0), mask.repeat_interleave(2, 0), generated, kept
    )
    assert_same_memory(cached, expected, **TOL)
    assert_same_memory(plain, expected, **TOL)


def test_beam_search_through_the_generation_config(model):
    from transformers import GenerationConfig

    prompt, mask = prompt_batch((5,))
    start = history_cache(model, 1)
    cache = start.clone()
    config = GenerationConfig(num_beams=2, max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    with torch.no_grad():
        out = model.generate(
            input_ids=prompt, attention_mask=mask, memory_cache=cache, generation_config=config
        )
    assert cache.batch_size == 1 and out.shape[0] == 1


@pytest.mark.parametrize("which", ["model", "sliding", "read-only"])
def test_prompt_lookup_rolls_rejected_drafts_back(request, which):
    """Drafts the verifier rejects are cropped from the KV cache (a sliding-window one too) and
    rolled back from memory; a read-only call (``memory_write=False``) has nothing to roll back:
    its logits are those of plain read-only greedy decoding and the cache stays as it was."""
    model = request.getfixturevalue("model" if which == "read-only" else which)
    write = {"memory_write": False} if which == "read-only" else {}
    g = torch.Generator().manual_seed(7)
    motif = torch.randint(3, VOCAB, (4,), generator=g)
    prompt = motif.repeat(4)[None]  # repeats, so the lookup proposes drafts
    mask = torch.ones_like(prompt)
    start = history_cache(model, 1)
    plain_cache, cache = start.clone(), start.clone()
    plain = generate(model, prompt, mask, plain_cache, do_sample=False, max_new_tokens=10, **write)
    out = generate(
        model, prompt, mask, cache, do_sample=False, max_new_tokens=10, prompt_lookup_num_tokens=3, **write
    )
    assert torch.equal(out.sequences, plain.sequences)
    assert_same_memory(cache, states(plain_cache), **TOL)
    if write:
        assert_same_memory(cache, states(start), atol=0, rtol=0)
        n = len(plain.logits)  # the accepted drafts' logits: the verifier's, as greedy computes them
        torch.testing.assert_close(torch.stack(out.logits[-n:]), torch.stack(plain.logits), **TOL)


@pytest.mark.parametrize("assistant", ["lstmem", "plain"])
def test_assistant_model_drafts_never_stay_in_memory(model, assistant):
    """An assistant with its own LSTMem adapter, or a plain model: same tokens and memory as without."""
    helper = make(seed=9) if assistant == "lstmem" else tiny_model("qwen3", 11).double()
    prompt, mask = prompt_batch((6,))
    start = history_cache(model, 1)
    plain_cache, cache = start.clone(), start.clone()
    plain = generate(model, prompt, mask, plain_cache, do_sample=False, max_new_tokens=8)
    out = generate(model, prompt, mask, cache, do_sample=False, max_new_tokens=8, assistant_model=helper)
    assert torch.equal(out.sequences, plain.sequences)
    assert_same_memory(cache, states(plain_cache), **TOL)


@pytest.mark.parametrize("exit_layer", [1, 2])
def test_self_speculative_early_exit_drafts_read_memory_and_only_verified_tokens_write(
    model, exit_layer, monkeypatch
):
    """Early exit drafts with the model's first layers against the verified memory (read-only, only
    the memory layers below the exit run); the full-stack verifier writes, rolled back with the KV crop."""
    from lstmem_peft.tuner.generation import GenerateSession

    drafts = []
    draft_memory = GenerateSession.draft_memory

    def spy(self, *args):
        drafts.append(self.position)
        return draft_memory(self, *args)

    monkeypatch.setattr(GenerateSession, "draft_memory", spy)
    prompt, mask = prompt_batch((6,))
    start = history_cache(model, 1)
    plain_cache, cache = start.clone(), start.clone()
    plain = generate(model, prompt, mask, plain_cache, do_sample=False, max_new_tokens=8)
    layers = model.config.num_hidden_layers
    out = generate(
        model, prompt, mask, cache, do_sample=False, max_new_tokens=8, assistant_early_exit=exit_layer
    )
    assert len(drafts) > 1 and max(drafts) > 0  # drafts ran, also after verified tokens were written
    assert torch.equal(out.sequences, plain.sequences)
    check(model, start, prompt, mask, out, cache)
    assert model.config.num_hidden_layers == layers


def test_a_draft_that_raises_leaves_the_cache_and_the_layer_count_as_they_were(model):
    """transformers' early exit does not restore ``num_hidden_layers`` when a draft raises; generate does."""
    from transformers import LogitsProcessorList

    calls = []

    def boom(input_ids, scores):
        calls.append(input_ids.shape[1])
        if len(calls) == 2:  # the assistant drafts first: this is inside a draft
            raise RuntimeError("boom")
        return scores

    prompt, mask = prompt_batch((6,))
    cache = history_cache(model, 1)
    before, layers = states(cache), model.config.num_hidden_layers
    with pytest.raises(RuntimeError, match="boom"):
        generate(
            model,
            prompt,
            mask,
            cache,
            do_sample=False,
            assistant_early_exit=1,
            logits_processor=LogitsProcessorList([boom]),
        )
    assert model.config.num_hidden_layers == layers
    assert_same_memory(cache, before, atol=0, rtol=0)


class _HostEvent:
    """A CUDA/MPS event's interface for the CPU, where every operation has finished when it returns."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args):
        pass

    def synchronize(self):
        pass


@pytest.mark.parametrize("kv", ["returned", "user", "dropped"])
def test_the_deferred_stop_check_writes_no_token_past_the_stop(model, monkeypatch, kv):
    """transformers defers the stop check by one step on mps: one more forward runs after every row
    finished, and the KV cache, when it outlives the call, is cropped back. Forced on the CPU here (its
    events are no-ops: the CPU is synchronous), tokens and memory must be those without the deferral."""
    from transformers.generation import utils as generation_utils

    from lstmem_peft.tuner.generation import GenerateSession

    prompt, mask = prompt_batch((6,))
    start = history_cache(model, 1)
    out = generate(model, prompt, mask, start.clone(), do_sample=False, eos_token_id=None)
    eos = int(out.sequences[0, prompt.shape[1] + 2])  # the row's third token ends it
    kwargs = dict(eos_token_id=eos, max_new_tokens=12)
    if kv == "dropped":
        kwargs.update(return_dict_in_generate=False, output_logits=False)

    def run():
        cache, forwards = start.clone(), []
        done = GenerateSession.forward_done
        with monkeypatch.context() as patch:
            patch.setattr(
                GenerateSession, "forward_done", lambda self, *a: forwards.append(1) or done(self, *a)
            )
            user = dict(past_key_values=DynamicCache()) if kv == "user" else {}
            return (
                generate(model, prompt, mask, cache, do_sample=False, **kwargs, **user),
                cache,
                len(forwards),
            )

    ref, ref_cache, ref_forwards = run()
    deferred = []

    def supported(device, cache, cache_is_returned, is_assistant):
        deferred.append(cache_is_returned)
        return not is_assistant

    monkeypatch.setattr(generation_utils.DeferredStopCheck, "is_supported", staticmethod(supported))
    monkeypatch.setattr(torch, "Event", _HostEvent)
    out, cache, forwards = run()
    assert deferred == [kv != "dropped"] and forwards == ref_forwards + 1  # one forward past the stop
    sequences = out if kv == "dropped" else out.sequences
    assert torch.equal(sequences, ref if kv == "dropped" else ref.sequences)
    assert eos in sequences[0, prompt.shape[1] :].tolist()
    assert_same_memory(cache, states(ref_cache), **TOL)
    if kv != "dropped":
        check(model, start, prompt, mask, out, cache, stop_token=eos)


def test_inputs_embeds(model):
    prompt, mask = prompt_batch()
    start = history_cache(model, 2)
    by_ids, by_embeds = start.clone(), start.clone()
    ref = generate(model, prompt, mask, by_ids, do_sample=False)
    embeds = model.get_input_embeddings()(prompt)
    with torch.no_grad():
        out = model.generate(
            inputs_embeds=embeds,
            attention_mask=mask,
            memory_cache=by_embeds,
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=PAD,
        )
    assert torch.equal(out, ref.sequences[:, prompt.shape[1] :])
    assert_same_memory(by_embeds, states(by_ids), **TOL)


def test_multi_turn_with_a_user_kv_cache(model):
    prompt, mask = prompt_batch((5, 5))
    start = history_cache(model, 2)
    cache, kv = start.clone(), DynamicCache()
    first = generate(model, prompt, mask, cache, do_sample=False, past_key_values=kv, max_new_tokens=4)
    follow = torch.randint(3, VOCAB, (2, 3), generator=torch.Generator().manual_seed(8))
    ids2 = torch.cat([first.sequences, follow], 1)
    mask2 = torch.cat([mask, torch.ones_like(ids2[:, mask.shape[1] :])], 1)
    second = generate(model, ids2, mask2, cache, do_sample=False, past_key_values=kv, max_new_tokens=4)
    # turn 1 forwarded all but its last token, turn 2's prefill that token and the follow-up: the
    # oracle is the whole conversation from the memory before turn 1
    check(model, start, ids2, mask2, second, cache)


def test_streamer_in_a_thread(model):
    class Collect(BaseStreamer):
        def __init__(self):
            self.tokens = []

        def put(self, value):
            self.tokens.append(value)

        def end(self):
            pass

    prompt, mask = prompt_batch((6,))
    start = history_cache(model, 1)
    plain_cache, cache = start.clone(), start.clone()
    ref = generate(model, prompt, mask, plain_cache, do_sample=False)
    streamer, result = Collect(), {}

    def run():
        with torch.no_grad():
            result["out"] = model.generate(
                input_ids=prompt,
                attention_mask=mask,
                memory_cache=cache,
                max_new_tokens=6,
                do_sample=False,
                pad_token_id=PAD,
                streamer=streamer,
            )

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=120)
    assert torch.equal(result["out"], ref.sequences) and len(streamer.tokens) == 7
    assert_same_memory(cache, states(plain_cache), atol=0, rtol=0)


def test_pipeline_text_generation():
    from transformers import pipeline

    from lstmem_peft.utils.offline import char_tokenizer, tiny_qwen3

    tok = char_tokenizer()
    model = get_peft_model(tiny_qwen3(vocab_size=len(tok), hidden_size=48, seed=4), LSTMemConfig()).eval()
    randomize_memory(model, seed=5)
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    text = pipe("hello", max_new_tokens=5, do_sample=False, return_full_text=False)[0]["generated_text"]
    ids = tok("hello", return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
    assert text == tok.decode(ref[0, ids.shape[1] :], skip_special_tokens=True)


CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_chat_template_conversations_in_a_padded_batch():
    """Prompts built by ``apply_chat_template`` (two conversations of different lengths, left-padded)
    meet the contract; ``pipeline`` with chat messages answers as ``generate`` on the same ids."""
    from transformers import pipeline

    from lstmem_peft.utils.offline import char_tokenizer, tiny_qwen3

    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    model = get_peft_model(tiny_qwen3(vocab_size=len(tok), hidden_size=48, seed=4).double(), LSTMemConfig())
    randomize_memory(model.eval(), seed=5)
    chats = [
        [{"role": "user", "content": "what did I say?"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
    ]
    batch = tok.apply_chat_template(chats, add_generation_prompt=True, padding=True, return_dict=True)
    prompt, mask = torch.tensor(batch["input_ids"]), torch.tensor(batch["attention_mask"])
    assert (mask == 0).any(dim=1).tolist() == [True, False], "the shorter conversation is left-padded"
    start = MemoryCache()
    with torch.no_grad():
        write_history(model, torch.tensor([tok.encode("a note")] * 2), start, progress=False)
    cache = start.clone()
    out = generate(model, prompt, mask, cache, pad_token_id=tok.pad_token_id)
    check_contract(model, start, prompt, mask, out, cache, **TOL)

    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    reply = pipe(chats[1], max_new_tokens=4, do_sample=False)[0]["generated_text"][-1]
    ids = torch.tensor(
        [tok.apply_chat_template(chats[1], add_generation_prompt=True, return_dict=True)["input_ids"]]
    )
    with torch.no_grad():
        ref = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    assert reply["role"] == "assistant"
    assert reply["content"] == tok.decode(ref[0, ids.shape[1] :], skip_special_tokens=True)


@pytest.mark.parametrize("mode", ["greedy", "num_return_sequences", "use_cache=False"])
def test_memory_write_false_reads_the_starting_memory_at_every_step(model, mode):
    """``generate(..., memory_write=False)``: each token's logits equal one read-only forward over
    prompt + tokens so far from the starting memory, and the cache is left as it was."""
    kwargs = {k: v for k, v in EXACT_MODES[mode].items()}
    repeats = kwargs.get("num_return_sequences", 1)
    prompt, mask = prompt_batch()
    start = history_cache(model, 2)
    cache = start.clone()
    torch.manual_seed(0)
    out = generate(model, prompt, mask, cache, memory_write=False, **kwargs)
    assert_same_memory(cache, states(expand(start, repeats)), atol=0, rtol=0)
    ids, full = prompt.repeat_interleave(repeats, 0), mask.repeat_interleave(repeats, 0)
    generated = out.sequences[:, ids.shape[1] :]
    reference = expand(start, repeats)
    for j, logits in enumerate(out.logits):
        step_ids = torch.cat([ids, generated[:, :j]], 1)
        step_mask = torch.cat([full, torch.ones_like(generated[:, :j])], 1)
        with torch.no_grad():
            ref = model(
                input_ids=step_ids,
                attention_mask=step_mask,
                position_ids=(step_mask.cumsum(-1) - 1).clamp_min(0),
                memory_cache=reference.clone(),
                memory_write=False,
                use_cache=False,
            ).logits[:, -1]
        torch.testing.assert_close(logits.double(), ref.double(), **TOL)


def test_read_only_generation_expands_but_never_writes(model):
    prompt, mask = prompt_batch()
    ro = make(update_during_generation=False)
    ro.load_state_dict(model.state_dict(), strict=False)
    start = history_cache(ro, 2)
    cache = start.clone()
    generate(ro, prompt, mask, cache, do_sample=True, num_return_sequences=2)
    assert_same_memory(cache, states(expand(start, 2)), atol=0, rtol=0)


# ---------------------------------------------------------------------- modes that are refused clearly
REFUSED = {
    "classifier-free guidance": (dict(guidance_scale=1.5), NotImplementedError, "classifier-free guidance"),
    "paged attention": (dict(cache_implementation="paged"), NotImplementedError, "continuous batching"),
    "own assistant": (dict(assistant_model="self"), NotImplementedError, "assistant_early_exit"),
    "greedy num_return_sequences": (
        dict(do_sample=False, num_return_sequences=2),
        ValueError,
        "num_return_sequences",
    ),
}


@pytest.mark.parametrize("mode", sorted(REFUSED))
def test_inexact_modes_are_refused_before_the_cache_is_touched(model, mode):
    kwargs, error, message = REFUSED[mode]
    if kwargs.get("assistant_model") == "self":
        kwargs = dict(kwargs, assistant_model=model)
    prompt, mask = prompt_batch()
    cache = history_cache(model, 2)
    before = states(cache)
    layers_before = model.config.num_hidden_layers
    with pytest.raises(error, match=message):
        generate(model, prompt, mask, cache, **kwargs)
    assert_same_memory(cache, before, atol=0, rtol=0)
    assert model.config.num_hidden_layers == layers_before


def test_beam_search_on_a_user_kv_cache_is_refused(model):
    prompt, mask = prompt_batch()
    with pytest.raises(NotImplementedError, match="past_key_values"):
        generate(model, prompt, mask, MemoryCache(), num_beams=2, past_key_values=DynamicCache())


def test_a_failed_call_leaves_the_cache_as_it_was(model):
    prompt, mask = prompt_batch()
    cache = history_cache(model, 2)
    before = states(cache)

    def boom(input_ids, scores, **kwargs):
        if input_ids.shape[1] > prompt.shape[1] + 2:
            raise KeyboardInterrupt
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    from transformers import StoppingCriteriaList

    with pytest.raises(KeyboardInterrupt):
        generate(model, prompt, mask, cache, do_sample=False, stopping_criteria=StoppingCriteriaList([boom]))
    assert_same_memory(cache, before, atol=0, rtol=0)
    # and the model works normally afterwards
    out = generate(model, prompt, mask, cache, do_sample=False)
    check(model, history_cache(model, 2), prompt, mask, out, cache)


def test_a_kv_continuation_without_its_memory_is_refused(model):
    kv = DynamicCache()
    prompt, mask = prompt_batch((4,))
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=kv, use_cache=True, memory_cache=MemoryCache())
        with pytest.raises(ValueError, match="no memory_cache"):
            model(input_ids=prompt[:, :1], past_key_values=kv, use_cache=True)


def test_packed_sequences_are_refused(model):
    ids = torch.randint(3, VOCAB, (1, 8))
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    with pytest.raises(ValueError, match="packed"):
        model(input_ids=ids, position_ids=position_ids, memory_cache=MemoryCache())


# ---------------------------------------------------------------------- adapters and threads
def test_a_cache_belongs_to_one_adapter():
    model = make()
    model.add_adapter("other", LSTMemConfig())
    cache = MemoryCache()
    with torch.no_grad():
        model(input_ids=torch.randint(3, VOCAB, (1, 4)), memory_cache=cache)
        model.set_adapter("other")
        with pytest.raises(ValueError, match="another adapter"):
            model(input_ids=torch.randint(3, VOCAB, (1, 4)), memory_cache=cache)


def test_two_threads_with_their_own_caches_get_what_each_gets_alone(model):
    prompts = [prompt_batch((6,), seed=s)[0] for s in (1, 2)]
    alone = []
    for p in prompts:
        c = MemoryCache()
        with torch.no_grad():
            logits = model(input_ids=p, memory_cache=c).logits
        alone.append((logits, states(c)))
    barrier = threading.Barrier(2)
    results = [None, None]
    original = model.base_model.model.model.layers[0].self_attn.q_proj.forward

    def run(i):
        c = MemoryCache()
        with torch.no_grad():
            results[i] = (model(input_ids=prompts[i], memory_cache=c).logits, c)

    # make the two forwards overlap: each waits for the other inside the first memory layer, then the
    # forward that opened first finishes first (first in, first out)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    arrivals, lock = [], threading.Lock()

    def synced(x, *args, **kwargs):
        with lock:
            arrivals.append(threading.get_ident())
        barrier.wait(timeout=30)
        if arrivals[-1] == threading.get_ident():
            time.sleep(0.3)
        return original(x, *args, **kwargs)

    q_proj.forward = synced
    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        del q_proj.forward
    for (logits, cache), (ref_logits, ref_states) in zip(results, alone, strict=True):
        assert torch.equal(logits, ref_logits)
        assert_same_memory(cache, ref_states, atol=0, rtol=0)
