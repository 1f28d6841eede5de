"""One invariant battery over every supported architecture and the adapter's main configurations:
zero memory is the base model, generation meets its exactness contract with padding and a row that
finishes early, and a history written in blocks continues exactly from a saved snapshot; and the
whole flow on each architecture: write, save, load through PEFT, the same answer, a training step."""

import pytest
import torch
from oracle import PAD, check_contract
from peft import PeftModel, get_peft_model
from tiny_models import ARCHITECTURES, VOCAB, history_then_question_logits, randomize_memory, tiny_model

from lstmem_peft import LSTMemConfig, MemoryCache, write_history

CONFIGS = {
    "all layers": dict(),
    "layers 0 and 2": dict(layers_to_transform=[0, 2]),
    "no depth coupling": dict(depth_coupling=False),
    "no feedback": dict(block_feedback=False),
    "bf16 states": dict(state_dtype="bfloat16"),
}
# float64 backbone and adapter: the states' own precision bounds the differences between paths
# (float32: 2^-24 per step; bfloat16: 2^-8 per rounding, a few dozen roundings here)
TOLERANCES = {"float32": dict(atol=1e-5, rtol=1e-5), "bfloat16": dict(atol=5e-2, rtol=5e-2)}
# backbones that cannot run in float64 (tiny_models.py says why): float32 throughout, where the
# backbone's own rounding (2^-24 per operation, a few hundred operations deep) bounds the paths
FLOAT32_BACKBONES = {"gemma2"}
FLOAT32_TOLERANCE = dict(atol=1e-4, rtol=1e-4)


def backbone(arch):
    base = tiny_model(arch)
    return base if arch in FLOAT32_BACKBONES else base.double()


def make(arch, config):
    model = get_peft_model(backbone(arch), LSTMemConfig(**config))
    randomize_memory(model)
    return model.eval()


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_invariants(arch, config):
    model = make(arch, CONFIGS[config])
    tol = TOLERANCES[model.peft_config["default"].state_dtype]
    if arch in FLOAT32_BACKBONES:
        tol = {k: max(v, FLOAT32_TOLERANCE[k]) for k, v in tol.items()}
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, VOCAB, (2, 6), generator=g)
    prompt[1, :2] = PAD
    mask = (torch.arange(6)[None] >= torch.tensor([[0], [2]])).long()
    with torch.no_grad():
        # zero memory == the base model, exactly
        with model.disable_adapter():
            base_logits = model(input_ids=prompt, attention_mask=mask).logits
        start = MemoryCache()
        write_history(
            model, torch.randint(3, VOCAB, (2, 24), generator=g), start, block_size=10, progress=False
        )
        # generation: pick an EOS that row 0 generates at its second step, then check the contract
        free = model.generate(
            input_ids=prompt,
            attention_mask=mask,
            memory_cache=start.clone(),
            max_new_tokens=5,
            do_sample=False,
            pad_token_id=PAD,
            eos_token_id=None,
        )
        eos = int(free[0, 7])
        cache = start.clone()
        out = model.generate(
            input_ids=prompt,
            attention_mask=mask,
            memory_cache=cache,
            max_new_tokens=5,
            do_sample=False,
            pad_token_id=PAD,
            eos_token_id=eos,
            return_dict_in_generate=True,
            output_logits=True,
        )
    assert not torch.equal(out.logits[0].double(), base_logits[:, -1].double())  # memory matters
    check_contract(model, start, prompt, mask, out, cache, stop_token=eos, **tol)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_whole_flow_save_load_and_train_a_step(arch, tmp_path):
    model = make(arch, {})
    answer = history_then_question_logits(model)
    model.save_pretrained(tmp_path)
    # the adapter loaded onto a fresh copy of the backbone answers the same, bit for bit
    loaded = PeftModel.from_pretrained(backbone(arch), tmp_path).eval()
    torch.testing.assert_close(history_then_question_logits(loaded), answer, rtol=0, atol=0)

    # one training step: every memory parameter moves, no backbone parameter does
    trainable = PeftModel.from_pretrained(backbone(arch), tmp_path, is_trainable=True).train()
    adapter = {n: p for n, p in trainable.named_parameters() if p.requires_grad}
    assert adapter and all(".lstmem_memory." in n for n in adapter)
    frozen = {n: p.detach().clone() for n, p in trainable.named_parameters() if not p.requires_grad}
    before = {n: p.detach().clone() for n, p in adapter.items()}
    ids = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(3))
    loss = trainable(input_ids=ids, labels=ids, memory_cache=MemoryCache()).loss
    assert torch.isfinite(loss)
    loss.backward()
    torch.optim.SGD(adapter.values(), lr=1e-2).step()
    still = [n for n, p in adapter.items() if torch.equal(p, before[n])]
    assert not still, still
    assert all(torch.equal(p, frozen[n]) for n, p in trainable.named_parameters() if not p.requires_grad)
