"""Gradient checkpointing (transformers' ``gradient_checkpointing_enable``) is exact for LSTMem memory:
the recomputed decoder layers replay the forward's memory corrections, memory runs and is written once."""

import copy
import warnings

import pytest
import torch
from tiny_models import VOCAB, make

from lstmem_peft import MemoryCache, write_history


def _model(**config):
    model = make("qwen3", **config).double()
    model.train()
    return model


def _step(model, history, question, target):
    """A stage-1 step: history blocks written with gradients (feedback at block ends), then an answer."""
    cache = MemoryCache()
    write_history(model, history, cache, block_size=8, progress=False)
    logits = model(input_ids=question, memory_cache=cache).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    return loss.detach(), grads, cache


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    history = torch.randint(3, VOCAB, (2, 28), generator=g)
    question = torch.randint(3, VOCAB, (2, 6), generator=g)
    target = torch.randint(3, VOCAB, (2, 6), generator=g)
    return history, question, target


def _assert_same_loss_and_gradients(plain, other, data):
    """One step of each model on ``data``: equal loss (float64, to rounding) and equal gradients."""
    loss_a, grads_a, _ = _step(plain, *data)
    loss_b, grads_b, _ = _step(other, *data)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-12, atol=0)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-10, atol=1e-13, msg=name)


@pytest.mark.parametrize("kwargs", [None, {"use_reentrant": False}])
def test_checkpointed_step_equals_the_plain_step_in_loss_gradients_and_memory(kwargs):
    plain = _model()
    checkpointed = copy.deepcopy(plain)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    assert checkpointed.base_model.model.is_gradient_checkpointing
    data = _data()
    loss_a, grads_a, cache_a = _step(plain, *data)
    loss_b, grads_b, cache_b = _step(checkpointed, *data)
    assert torch.isfinite(loss_a)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-12, atol=0)
    assert grads_a.keys() == grads_b.keys() and any("lstmem_memory" in n for n in grads_a)
    assert all("lstmem_memory" in n for n in grads_a)  # only the adapter trains
    for name, grad in grads_a.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-10, atol=1e-13, msg=name)
    # memory written once per block: the same states and token counts
    assert torch.equal(cache_b.tokens_written, cache_a.tokens_written)
    assert int(cache_a.tokens_written[0]) == data[0].shape[1] + data[1].shape[1]
    for state_a, state_b in zip(cache_a.layers, cache_b.layers, strict=True):
        torch.testing.assert_close(state_b.cell, state_a.cell, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(state_b.hidden, state_a.hidden, rtol=1e-12, atol=1e-14)


def test_checkpointing_only_some_layers_is_exact_too():
    plain = _model()
    checkpointed = copy.deepcopy(plain)
    checkpointed.base_model.model.activation_checkpointing_enable(every_n_layers=2)
    _assert_same_loss_and_gradients(plain, checkpointed, _data(1))


@pytest.mark.parametrize("kwargs", [{"use_reentrant": True}, {}])
def test_reentrant_checkpointing_is_refused_with_the_fix_named(kwargs):
    """``{}`` leaves the choice to torch, which takes reentrant: what PEFT's
    ``prepare_model_for_kbit_training`` passes by default."""
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    history, question, _ = _data()
    with pytest.raises(
        RuntimeError, match=r'reentrant.*gradient_checkpointing_kwargs=\{"use_reentrant": False\}'
    ):
        model(input_ids=question, memory_cache=MemoryCache())
    # without gradients (evaluation) nothing is recomputed: it runs
    with torch.no_grad():
        model(input_ids=question, memory_cache=MemoryCache())


def test_peft_kbit_preparation_defaults_are_refused_and_its_non_reentrant_form_is_exact():
    from peft import prepare_model_for_kbit_training

    plain = _model()
    prepared = copy.deepcopy(plain)
    base = prepared.base_model.model
    base.is_loaded_in_4bit = True  # the preparation only enables checkpointing on quantised models
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepare_model_for_kbit_training(base)
    assert base.is_gradient_checkpointing
    prepared.train()
    with pytest.raises(RuntimeError, match="prepare_model_for_kbit_training"):
        _step(prepared, *_data())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepare_model_for_kbit_training(base, gradient_checkpointing_kwargs={"use_reentrant": False})
    prepared.double().train()
    for p in prepared.parameters():  # the preparation freezes everything; the adapter trains again
        p.requires_grad_(False)
    for name, p in prepared.named_parameters():
        p.requires_grad_("lstmem_memory" in name)
    plain_params = dict(plain.named_parameters())
    for name, p in prepared.named_parameters():  # the preparation casts norms to float32: same values
        assert torch.equal(p, plain_params[name])
    _assert_same_loss_and_gradients(plain, prepared, _data())


def test_trl_selective_activation_checkpointing_is_exact():
    """TRL's ``gradient_checkpointing_kwargs={"selective": True}`` sets its own ``context_fn``."""
    from trl.models import enable_selective_activation_checkpointing

    plain = _model()
    selective = copy.deepcopy(plain)
    base = selective.base_model.model
    enable_selective_activation_checkpointing(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"selective": True})
    _assert_same_loss_and_gradients(plain, selective, _data(2))


def _trainer_losses(tmp_path, checkpointing, steps=3):
    from datasets import Dataset
    from peft import get_peft_model

    from lstmem_peft import LSTMemConfig
    from lstmem_peft.training.data import synthetic_recall_episodes, tokenize_episode
    from lstmem_peft.training.trainer import LSTMemTrainer, LSTMemTrainingConfig
    from lstmem_peft.utils.offline import demo_tokenizer, tiny_qwen3

    tok = demo_tokenizer()
    torch.manual_seed(0)
    model = get_peft_model(
        tiny_qwen3(len(tok), hidden_size=64, num_layers=2), LSTMemConfig(block_size=8)
    ).double()
    data = Dataset.from_list([tokenize_episode(tok, e) for e in synthetic_recall_episodes(16, 2, seed=0)])
    args = LSTMemTrainingConfig(
        output_dir=str(tmp_path / str(checkpointing)),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        logging_steps=1,
        disable_tqdm=True,
        context_dropout=0.0,
        seed=0,
        data_seed=0,
        gradient_checkpointing=checkpointing,  # the Trainer enables it (non-reentrant by default)
    )
    trainer = LSTMemTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
    trainer.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert model.base_model.model.is_gradient_checkpointing == checkpointing
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if "lstmem_memory" in n}
    return losses, weights


def test_training_with_checkpointing_matches_training_without(tmp_path):
    losses_a, weights_a = _trainer_losses(tmp_path, False)
    losses_b, weights_b = _trainer_losses(tmp_path, True)
    assert len(losses_a) == 3 and all(torch.isfinite(torch.tensor(loss)) for loss in losses_a)
    assert losses_b == pytest.approx(losses_a, rel=1e-9)
    for name, weight in weights_a.items():
        torch.testing.assert_close(weights_b[name], weight, rtol=1e-9, atol=1e-12, msg=name)


def test_a_checkpointed_forward_without_backward_frees_its_graph():
    """Nothing the checkpoint keeps for its recompute reaches back into the graph (a cycle through
    autograd's nodes would outlive the forward: the garbage collector cannot see it)."""
    import gc
    import weakref

    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable()
    history, question, _ = _data()
    cache = MemoryCache()
    write_history(model, history, cache, block_size=8, progress=False)
    logits = model(input_ids=question, memory_cache=cache).logits
    assert logits.requires_grad and cache.layers[0].cell.requires_grad
    refs = [weakref.ref(logits), *(weakref.ref(state.cell) for state in cache.layers)]
    del logits, cache
    gc.collect()
    assert all(ref() is None for ref in refs)
