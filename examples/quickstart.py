"""Attach LSTMem to a causal LM, write a history into memory, ask two questions from one snapshot,
then save and reload the adapter.

    python examples/quickstart.py                       # tiny offline model (untrained: text is noise)
    python examples/quickstart.py --model Qwen/Qwen3-0.6B   # a Hub model (needs it cached or online)
"""

from __future__ import annotations

import argparse
import tempfile

import torch

HISTORY = (
    "Maya's locker code is 4417. The team meeting moved to Thursday at 3 pm. "
    "Leo parked the blue van on level B2. The spare keys are in the red drawer. "
) * 4
QUESTIONS = ["What is Maya's locker code?", "Where did Leo park the van?"]


def load(model_id: str | None):
    if model_id is None:
        from lstmem_peft.utils.offline import char_tokenizer, tiny_qwen3

        tokenizer = char_tokenizer()
        return tiny_qwen3(vocab_size=len(tokenizer)), tokenizer
    from lstmem_peft.tuner.loading import load_model_and_adapter

    model, tokenizer = load_model_and_adapter(model_id)  # the checkpoint's dtype, on cuda when there is one
    tokenizer.padding_side = "left"
    return model, tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="Hub id or local path (default: a tiny offline Qwen3)")
    ap.add_argument("--max-new-tokens", type=int, default=20)
    args = ap.parse_args()
    # what `lstmem` keeps off the terminal (README "Warnings"): transformers' weight-loading bars, the
    # deprecation PEFT's own get_peft_model triggers (transformers' is_gradient_checkpointing) and what
    # the quantisation backends log while PEFT imports them, hence PEFT's import only after this
    from lstmem_cli.quiet import quiet_command

    quiet_command(loads_models=args.model is not None)
    from peft import PeftModel, get_peft_model

    from lstmem_peft import LSTMemConfig, MemoryCache, memory_layers, write_history

    base, tokenizer = load(args.model)
    model = get_peft_model(base, LSTMemConfig(r=8, num_heads=4, block_size=128))
    model.print_trainable_parameters()
    print(f"memory layers: {[layer.layer_idx for layer in memory_layers(model)]}")

    # 1. Write the history into memory (blocks of 128 tokens, feedback after each).
    history = tokenizer(HISTORY, return_tensors="pt")
    cache = MemoryCache()
    with torch.no_grad():
        write_history(model, history.input_ids, cache, attention_mask=history.attention_mask)
    print(f"wrote {cache.tokens_written.tolist()} tokens; memory holds {cache.nbytes / 1024:.1f} KiB")

    # 2. Answer two questions from the same snapshot: neither sees the other's updates.
    snapshot = cache.clone()
    for question in QUESTIONS:
        prompt = tokenizer(question, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(
                **prompt,
                memory_cache=snapshot.clone(),
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        answer = tokenizer.decode(out[0, prompt.input_ids.shape[1] :], skip_special_tokens=True)
        print(f"Q: {question}\nA: {answer!r}")

    # 3. Save the adapter and the memory, reload both, check the reloaded model answers the same.
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        snapshot.save(f"{tmp}/memory.safetensors")
        base2, _ = load(args.model)
        reloaded = PeftModel.from_pretrained(base2, tmp).eval()
        memory = MemoryCache.load(f"{tmp}/memory.safetensors")
        prompt = tokenizer(QUESTIONS[0], return_tensors="pt")
        with torch.no_grad():
            a = model(**prompt, memory_cache=snapshot.clone()).logits
            b = reloaded(**prompt, memory_cache=memory).logits
        print(f"reloaded adapter + memory give identical logits: {torch.equal(a, b)}")


if __name__ == "__main__":
    main()
