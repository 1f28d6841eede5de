"""Episode data, the collator and the TRL trainer (App. C.4), including DDP on two CPU processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from eval_fixtures import QASPER_OFFICIAL
from peft import get_peft_model

from lstmem_peft import LSTMemConfig
from lstmem_peft.training.data import load_episodes, synthetic_recall_episodes, tokenize_episode
from lstmem_peft.training.trainer import EpisodeCollator, LSTMemTrainer, LSTMemTrainingConfig
from lstmem_peft.utils.offline import char_tokenizer, demo_tokenizer, tiny_qwen3

ROOT = Path(__file__).resolve().parents[1]

QASPER_HUB_ROW = {  # the Hub dataset: columns of lists
    "id": "1909.00002",
    "title": "Other",
    "abstract": "Abstract.",
    "full_text": {"section_name": ["Method"], "paragraphs": [["We count spans."]]},
    "qas": {
        "question": ["What is counted?"],
        "question_id": ["q1"],
        "answers": [
            {
                "answer": [
                    {
                        "unanswerable": False,
                        "extractive_spans": ["spans", "words"],
                        "yes_no": None,
                        "free_form_answer": "",
                        "evidence": [],
                        "highlighted_evidence": [],
                    }
                ],
                "annotation_id": ["a"],
                "worker_id": ["w"],
            }
        ],
    },
}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_chat_jsonl_episodes(tmp_path):
    path = write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {
                "messages": [
                    {"role": "user", "content": "My cat is called Miso."},
                    {"role": "assistant", "content": "Nice name!"},
                    {"role": "user", "content": "What is my cat called?"},
                    {"role": "assistant", "content": "Miso."},
                ]
            }
        ],
    )
    [ep] = load_episodes(path, "chat")
    assert "Miso" in ep["history"] and "What is my cat called?" in ep["prompt"] and ep["answer"] == " Miso."
    bad = write_jsonl(
        tmp_path / "bad.jsonl",
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "?"}]}],
    )
    with pytest.raises(ValueError, match="must end with a user message followed by the assistant answer"):
        load_episodes(bad, "chat")


def test_qasper_both_public_layouts(tmp_path):
    official = tmp_path / "qasper-train-v0.3.json"
    official.write_text(json.dumps(QASPER_OFFICIAL))
    eps = load_episodes(str(official), "qasper")
    assert [e["answer"] for e in eps] == [" tiny things", " No"]  # the unanswerable question is skipped
    assert eps[0]["history"].startswith("Tiny Paper") and "They are small." in eps[0]["history"]
    hub = load_episodes(write_jsonl(tmp_path / "hub.jsonl", [QASPER_HUB_ROW]), "qasper")
    assert [e["answer"] for e in hub] == [" spans, words"] and "We count spans." in hub[0]["history"]


def test_long_qa_episodes_and_history_cap(tmp_path):
    path = write_jsonl(
        tmp_path / "long.jsonl",
        [
            {
                "context": "x" * 500,
                "qas": [{"question": "Q1?", "answer": "a"}, {"question": "Q2?", "answer": "b"}],
            }
        ],
    )
    eps = load_episodes(path, "long_qa")
    assert len(eps) == 2 and eps[1]["answer"] == " b"
    tok = char_tokenizer()
    row = tokenize_episode(tok, eps[0], history_max_tokens=100)
    assert len(row["history_input_ids"]) == 101  # BOS + the first 100 history tokens
    assert row["labels"][:-3] == [-100] * (len(row["labels"]) - 3)  # " a" is two characters, then EOS
    assert row["labels"][-3:] == [*tok(" a", add_special_tokens=False)["input_ids"], tok.eos_token_id]
    with pytest.raises(ValueError, match="unknown episode format"):
        load_episodes(path, "csv")


def test_synthetic_recall_answers_only_in_history():
    for ep in synthetic_recall_episodes(50, num_pairs=8, seed=3):
        key = ep["prompt"].split()[-1]
        facts = dict(f.split() for f in ep["history"].split(" ;") if f.strip())
        assert len(facts) == 8 and facts[key] == ep["answer"].strip()
        assert ep["answer"].strip() not in ep["prompt"]


def test_collator_pads_limits_and_drops_context():
    tok = demo_tokenizer()
    rows = [tokenize_episode(tok, e) for e in synthetic_recall_episodes(4, num_pairs=2, seed=0)]
    rows[0]["history_input_ids"] = rows[0]["history_input_ids"][:3]
    batch = EpisodeCollator(pad_token_id=0, context_dropout=0.0)(rows)
    assert (
        batch["history_input_ids"].shape == (4, 7)
        and batch["history_attention_mask"][0].tolist() == [0] * 4 + [1] * 3
    )
    assert (batch["labels"] != -100).sum(1).tolist() == [2] * 4  # value + eos
    dropped = EpisodeCollator(pad_token_id=0, context_dropout=0.999)(rows)
    assert dropped["input_ids"].shape[1] == 3  # last prompt token + answer
    limited = EpisodeCollator(pad_token_id=0, context_dropout=0.0, answer_max_tokens=3)(rows)
    assert limited["input_ids"].shape[1] == 3 and (limited["labels"] != -100).sum() == 8


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(history_mode="stage3"), "history_mode"),
        (dict(context_dropout=1.0), "context_dropout"),
    ],
)
def test_training_config_validation(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LSTMemTrainingConfig(output_dir=str(tmp_path), **kwargs)


def test_training_config_defaults(tmp_path):
    args = LSTMemTrainingConfig(output_dir=str(tmp_path), use_cpu=True)
    assert not args.gradient_checkpointing and not args.remove_unused_columns
    assert args.dataset_kwargs == {"skip_prepare_dataset": True} and args.history_max_tokens == 8192
    assert LSTMemTrainingConfig(output_dir=str(tmp_path), history_mode="stage2").history_max_tokens == 131072


def _trainer(tmp_path, mode="stage1", steps=4, lr=1e-2, pairs=2):
    tok = demo_tokenizer()
    model = get_peft_model(tiny_qwen3(len(tok), hidden_size=64, num_layers=2), LSTMemConfig(block_size=8))
    data = Dataset.from_list([tokenize_episode(tok, e) for e in synthetic_recall_episodes(64, pairs, seed=0)])
    args = LSTMemTrainingConfig(
        output_dir=str(tmp_path),
        max_steps=steps,
        per_device_train_batch_size=16,
        learning_rate=lr,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        logging_steps=1,
        disable_tqdm=True,
        history_mode=mode,
        context_dropout=0.0,
    )
    return model, LSTMemTrainer(model=model, args=args, train_dataset=data, processing_class=tok)


@pytest.mark.parametrize("mode", ["stage1", "stage2"])
def test_trainer_trains_the_adapter_only(tmp_path, mode):
    model, trainer = _trainer(tmp_path, mode)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lstmem_memory" in n for n in changed)
    base = [n for n in before if "lstmem_memory" not in n]
    assert all(torch.equal(dict(model.named_parameters())[n], before[n]) for n in base)
    if mode == "stage1":  # gradients reach the write path (gates) through history writing and feedback
        assert any("w_gate" in n for n in changed)


def test_stage2_writes_history_without_gradients(tmp_path):
    model, trainer = _trainer(tmp_path, "stage2")
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    cache = trainer.write_episode_history(model, batch["history_input_ids"], batch["history_attention_mask"])
    assert all(not layer.cell.requires_grad and not layer.hidden.requires_grad for layer in cache.layers)
    _, stage1 = _trainer(tmp_path, "stage1")
    cache = stage1.write_episode_history(
        stage1.model, batch["history_input_ids"], batch["history_attention_mask"]
    )
    assert all(layer.cell.requires_grad for layer in cache.layers)


def test_training_lowers_the_answer_loss(tmp_path):
    model, trainer = _trainer(tmp_path, steps=30, lr=1e-2, pairs=1)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5


def test_trainer_refuses_models_without_adapter_and_missing_tokenizer(tmp_path):
    tok = demo_tokenizer()
    args = LSTMemTrainingConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(TypeError, match="carries no LSTMem adapter"):
        LSTMemTrainer(model=tiny_qwen3(len(tok), hidden_size=64), args=args, processing_class=tok)
    model = get_peft_model(tiny_qwen3(len(tok), hidden_size=64), LSTMemConfig())
    with pytest.raises(ValueError, match="processing_class"):
        LSTMemTrainer(model=model, args=args)


@pytest.mark.slow
def test_ddp_two_processes_end_with_identical_adapters(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        "29531",
        str(ROOT / "tests" / "scripts" / "ddp_train.py"),
        str(tmp_path),
    ]
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert all(r["world_size"] == 2 for r in ranks)
    w0, w1 = ranks[0]["weights"], ranks[1]["weights"]
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    tok = demo_tokenizer()
    init = get_peft_model(
        tiny_qwen3(len(tok), hidden_size=64, num_layers=2, seed=0), LSTMemConfig(block_size=32)
    )
    initial = dict(init.named_parameters())
    assert any(not torch.equal(w0[k], initial[k]) for k in w0)  # training moved the adapter


def test_generate_uses_memory_after_the_trainer_wrapped_the_model(tmp_path):
    """TRL patches the model (fused LM head); memory must still reach forward and generate."""
    model, trainer = _trainer(tmp_path, steps=2)
    trainer.train()
    model.eval()
    tok = demo_tokenizer()
    history = torch.tensor(
        [tokenize_episode(tok, e)["history_input_ids"] for e in synthetic_recall_episodes(2, 4, seed=5)]
    )
    question = torch.tensor([[tok.bos_token_id, tok.convert_tokens_to_ids("?"), 5]] * 2)
    from lstmem_peft import MemoryCache, write_history

    cache = MemoryCache()
    with torch.no_grad():
        write_history(model, history, cache, progress=False)
        written = cache.tokens_written.clone()
        with_memory = model(input_ids=question, memory_cache=cache.clone()).logits
        with model.disable_adapter():
            plain = model(input_ids=question).logits
        model.generate(
            input_ids=question, memory_cache=cache, max_new_tokens=3, min_new_tokens=3, do_sample=False
        )
    assert not torch.allclose(with_memory, plain)
    assert (cache.tokens_written == written + 3 + 2).all()  # prompt and all but the last generated token
