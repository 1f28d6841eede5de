"""The offline recall demo: does a trained LSTMem adapter answer from memory alone?

Task: histories of key-value facts ``<s> k07 v19 ; k12 v03 ; ...`` (8 pairs, 32 keys, 32 values)
and the question ``<s> ? k07``, answered ``v19``. The model answers three ways:

* history in the context window, no memory (upper bound);
* no history at all (chance);
* history written only into LSTMem memory, question alone (what the adapter adds).

How the embedded backbone was made (after DESIGN.md, "The recall demo"): a 2-layer Qwen3 (hidden
128, 4 query and 4 key-value heads of 32, untied embeddings) is pretrained in two phases:

A. the backbone alone on 75% copy sequences and 25% in-context recall, until in-context recall forms
   (with 2 key-value heads and tied embeddings it stayed at 0.2 through 1,000 steps here);
B. with LSTMem adapters in the loop: even steps copy, odd steps in-context recall plus memory-only
   recall, the adapter re-initialised (new seed, fresh optimiser state) every ``reinit_every``
   steps, so the backbone learns memory-friendly features without co-adapting to one adapter.

The backbone is then frozen and fresh adapters with the paper's structure and initialisation are
trained by :class:`~lstmem_peft.training.trainer.LSTMemTrainer` on histories of 1 to 8 facts (8 facts only
stayed at the 1/num_pairs plateau). ``python -m lstmem_peft.cli.demo build`` remakes the shipped files
and records its timings and scores in ``assets/demo/build.json``.

Beyond the 8-fact table (issue 26): :func:`evaluate_updates` (a later turn gives some keys new
values; the newest wins: where depth coupling and block-end feedback change recall),
:func:`show_episodes` (``lstmem demo --show``: episodes a person can read) and :func:`sweep`
(``lstmem demo --sweep``: recall against history length from one block to many, past the
backbone's :data:`WINDOW`, against the plain backbone cut to that window, with a plot).
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import Qwen3ForCausalLM

from lstmem_peft.memory.cache import MemoryCache
from lstmem_peft.training.data import (
    left_pad,
    long_recall_episodes,
    synthetic_recall_episodes,
    tokenize_episode,
)
from lstmem_peft.tuner.config import LSTMemConfig
from lstmem_peft.tuner.history import memory_layers, write_history
from lstmem_peft.tuner.loading import load_demo_backbone as load_backbone
from lstmem_peft.utils.offline import DEMO_ASSETS, NUM_KEYS, NUM_VALUES, demo_tokenizer, tiny_qwen3

NUM_PAIRS = 8
ADAPTERS = {
    "full": {},
    "no_depth_coupling": {"depth_coupling": False},
    "no_feedback": {"block_feedback": False},
}


def adapter_config(**overrides) -> LSTMemConfig:
    """The paper's adapter (n_h 4, r 8, alpha 16) on every layer; one block per demo history.
    ``overrides`` may change any of them (``r=16`` for a larger state)."""
    return LSTMemConfig(**{"r": 8, "num_heads": 4, "alpha": 16.0, "block_size": 64, **overrides})


# ---------------------------------------------------------------------- batches
@dataclass
class Batch:
    history: torch.Tensor  # (B, Th)
    question: torch.Tensor  # (B, Tq) "<s> ? k"
    answer: torch.Tensor  # (B,) value token id
    in_context: torch.Tensor  # (B, Th + Tq - 1) history followed by "? k"


def make_batch(tok, episodes: list[dict]) -> Batch:
    rows = [tokenize_episode(tok, e, add_eos=False) for e in episodes]
    history = torch.tensor([r["history_input_ids"] for r in rows])
    read = torch.tensor([r["input_ids"] for r in rows])
    question, answer = read[:, :-1], read[:, -1]
    return Batch(history, question, answer, torch.cat([history, question[:, 1:]], dim=1))


def copy_batch(tok, batch_size: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """``<s> x1..xn ? x1..xn`` with ``n`` drawn in [4, 24] per batch; loss on the copy.

    Varying lengths keep the model from copying by absolute position; mixed with recall data this
    forms the induction circuit that in-context recall needs (DESIGN.md measured 0.99 in-context
    recall; fixed-length copy data did not help).
    """
    n = rng.randint(4, 24)
    body = torch.randint(
        5, len(tok), (batch_size, n), generator=torch.Generator().manual_seed(rng.randrange(2**31))
    )
    bos = torch.full((batch_size, 1), tok.bos_token_id)
    sep = torch.full((batch_size, 1), tok.convert_tokens_to_ids("?"))
    ids = torch.cat([bos, body, sep, body], dim=1)
    labels = torch.full_like(ids, -100)
    labels[:, n + 2 :] = body
    return ids, labels


def answer_logits(model, ids: torch.Tensor, cache: MemoryCache | None = None) -> torch.Tensor:
    """Logits of the next token after ``ids`` (read-only memory when a cache is given)."""
    if cache is None:
        return model(input_ids=ids).logits[:, -1]
    return model(input_ids=ids, memory_cache=cache, memory_write=False).logits[:, -1]


def memory_answer_logits(model, batch: Batch) -> torch.Tensor:
    cache = MemoryCache()
    write_history(model, batch.history, cache, progress=False)
    return answer_logits(model, batch.question, cache)


# ---------------------------------------------------------------------- backbone pretraining
def _reinit_adapter(pairs: list, seed: int) -> None:
    """Fresh paper initialisation for every ``(memory layer, q_proj, o_proj)`` triple."""
    torch.manual_seed(seed)
    for layer, q_proj, o_proj in pairs:
        layer.reset_parameters()
        layer.init_corrections(q_proj.weight, o_proj.weight)


def pretrain_backbone(
    warm_steps: int = 800,
    steps: int = 1260,
    batch_size: int = 64,
    lr: float = 2e-3,
    warmup: int = 100,
    reinit_every: int = 210,
    seed: int = 0,
    progress: bool = True,
) -> Qwen3ForCausalLM:
    """Pretrain the demo backbone in two phases (see the module docstring).

    Phase A (``warm_steps``): the backbone alone, 75% copy batches and 25% in-context recall, until
    in-context recall forms. Phase B (``steps``): even steps copy, odd steps in-context recall plus
    memory-only recall through an LSTMem adapter that is re-initialised every ``reinit_every``
    steps (new seed, fresh optimiser state).
    """
    from peft import get_peft_model

    tok = demo_tokenizer()
    backbone = tiny_qwen3(
        len(tok), hidden_size=128, num_layers=2, num_kv_heads=4, tie_embeddings=False, seed=seed
    ).train()
    model = get_peft_model(backbone, adapter_config())
    for p in model.parameters():
        p.requires_grad_(True)
    triples = [
        (layer, attn.q_proj.base_layer, attn.o_proj.base_layer)
        for layer, attn in zip(
            memory_layers(model), (block.self_attn for block in backbone.model.layers), strict=True
        )
    ]
    base_params = [p for n, p in model.named_parameters() if "lstmem_memory" not in n]
    adapter_params = [p for n, p in model.named_parameters() if "lstmem_memory" in n]
    rng = random.Random(seed)
    opt = torch.optim.AdamW(base_params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    adapter_opt = None
    probe = make_batch(tok, synthetic_recall_episodes(256, NUM_PAIRS, seed=seed + 999))

    def copy_loss():
        ids, labels = copy_batch(tok, batch_size, rng)
        with model.disable_adapter():
            logits = model(input_ids=ids).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)

    def recall_batch():
        return make_batch(
            tok, synthetic_recall_episodes(batch_size, rng.randint(1, NUM_PAIRS), seed=rng.randrange(2**31))
        )

    bar = tqdm(range(warm_steps + steps), desc="pretraining backbone", disable=not progress)
    for step in bar:
        if progress and step % 100 == 0:
            with torch.no_grad(), model.disable_adapter():
                ctx = (
                    (answer_logits(model, probe.in_context).argmax(-1) == probe.answer).float().mean().item()
                )
            with torch.no_grad():
                mem = (memory_answer_logits(model, probe).argmax(-1) == probe.answer).float().mean().item()
            bar.set_postfix(in_context=f"{ctx:.2f}", memory=f"{mem:.2f}")
        joint = step - warm_steps
        if joint < 0:  # phase A
            if rng.random() < 0.75:
                loss = copy_loss()
            else:
                batch = recall_batch()
                with model.disable_adapter():
                    loss = F.cross_entropy(answer_logits(model, batch.in_context), batch.answer)
        else:  # phase B
            if joint % reinit_every == 0:
                _reinit_adapter(triples, seed=1000 + joint)
                adapter_opt = torch.optim.AdamW(adapter_params, lr=lr)
            if joint % 2 == 0:
                loss = copy_loss()
            else:
                batch = recall_batch()
                with model.disable_adapter():
                    in_context = F.cross_entropy(answer_logits(model, batch.in_context), batch.answer)
                loss = in_context + F.cross_entropy(memory_answer_logits(model, batch), batch.answer)
        opt.zero_grad()
        if adapter_opt is not None:
            adapter_opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if adapter_opt is not None:
            adapter_opt.step()
    return model.unload().eval()


# ---------------------------------------------------------------------- adapter training and evaluation
def train_adapter(
    backbone,
    overrides: dict | None = None,
    max_steps: int = 600,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 42,
    output_dir: str | None = None,
    progress: bool = True,
    tokenizer=None,
    max_facts: int = NUM_PAIRS,
):
    """Train a fresh adapter on the frozen backbone with :class:`LSTMemTrainer`; returns the PEFT
    model. Histories hold 1 to ``max_facts`` facts (the shipped adapters: 1 to 8)."""
    from peft import get_peft_model

    from lstmem_peft.training.trainer import LSTMemTrainer, LSTMemTrainingConfig
    from lstmem_peft.utils.extras import missing_extra

    try:
        from datasets import Dataset
    except ModuleNotFoundError as err:
        raise missing_extra(err, "train", "lstmem demo --train") from err

    tok = tokenizer or demo_tokenizer()
    torch.manual_seed(seed)
    model = get_peft_model(backbone, adapter_config(**(overrides or {})))
    # 1 to 8 facts per history: the easy histories bootstrap the key-value binding that 8-fact
    # histories need (with 8 facts only, training sat at the 1/num_pairs plateau); evaluation
    # always uses 8 facts.
    per_count = max_steps * batch_size // max_facts + 1
    episodes = [
        e
        for n in range(1, max_facts + 1)
        for e in synthetic_recall_episodes(per_count, n, NUM_KEYS, NUM_VALUES, seed=seed + n)
    ]
    data = Dataset.from_list([tokenize_episode(tok, e) for e in episodes])
    args = LSTMemTrainingConfig(
        output_dir=output_dir or tempfile.mkdtemp(prefix="lstmem-demo-"),
        max_steps=max_steps,
        per_device_train_batch_size=batch_size,
        learning_rate=lr,
        lr_scheduler_type="cosine",
        warmup_steps=0.05,
        logging_steps=25,
        save_strategy="no",
        report_to=[],
        seed=seed,
        context_dropout=0.0,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=not progress,
    )
    trainer = LSTMemTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
    trainer.train()
    return model.eval(), trainer


def _answers_correct(
    model, rows: list[list[int]], answer_lens: list[int], pad_id: int, cache=None
) -> torch.Tensor:
    """Per row: is every answer token (the last ``answer_lens[i]`` tokens) the argmax given its prefix?"""
    ids, mask = left_pad(rows, pad_id)
    kwargs = dict(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0))
    if cache is None:
        logits = model(**kwargs).logits
    else:
        logits = model(**kwargs, memory_cache=cache, memory_write=False).logits
    pred = logits[:, :-1].argmax(-1)
    target = ids[:, 1:]
    correct = torch.ones(len(rows), dtype=torch.bool)
    for i, n in enumerate(answer_lens):
        correct[i] = bool((pred[i, -n:] == target[i, -n:]).all())
    return correct


@torch.no_grad()
def evaluate(
    model,
    tokenizer=None,
    num_episodes: int = 512,
    seed: int = 12345,
    batch_size: int = 128,
    num_pairs: int = NUM_PAIRS,
    progress: bool = False,
) -> dict:
    """Recall on held-out episodes: exact match of the answer tokens, argmax over the whole vocabulary.

    ``recall_in_context``: adapter disabled, history then question in the context window.
    ``recall_no_history``: adapter disabled, the question alone.
    ``recall_memory``: the history written into LSTMem memory (blocks + feedback), then the question
    alone, memory read-only.
    """
    tok = tokenizer or demo_tokenizer()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    episodes = synthetic_recall_episodes(num_episodes, num_pairs, seed=seed)
    hits = {"recall_in_context": 0, "recall_no_history": 0, "recall_memory": 0}
    for start in tqdm(range(0, num_episodes, batch_size), desc="evaluating", disable=not progress):
        rows = [tokenize_episode(tok, e, add_eos=False) for e in episodes[start : start + batch_size]]
        reads = [r["input_ids"] for r in rows]
        n_ans = [sum(1 for y in r["labels"] if y != -100) for r in rows]
        histories = [r["history_input_ids"] for r in rows]
        in_context = [
            h + q[1:] if tok.bos_token_id is not None else h + q
            for h, q in zip(histories, reads, strict=True)
        ]
        with model.disable_adapter():
            hits["recall_in_context"] += _answers_correct(model, in_context, n_ans, pad).sum().item()
            hits["recall_no_history"] += _answers_correct(model, reads, n_ans, pad).sum().item()
        cache = MemoryCache()
        hist_ids, hist_mask = left_pad(histories, pad)
        write_history(model, hist_ids, cache, attention_mask=hist_mask, progress=False)
        hits["recall_memory"] += _answers_correct(model, reads, n_ans, pad, cache).sum().item()
    result = {k: v / num_episodes for k, v in hits.items()}
    result.update(
        chance=1 / NUM_VALUES, bag_of_values=1 / num_pairs, num_pairs=num_pairs, num_episodes=num_episodes
    )
    return result


# ---------------------------------------------------------------------- updates: the newest value wins
UPDATE_SEED = 4242


def update_episodes(
    num_episodes: int, first: int = NUM_PAIRS, updated: int = 4, seed: int = UPDATE_SEED
) -> list[dict]:
    """Two turns: ``first`` facts with distinct keys, then a later turn that gives ``updated`` of
    those keys new values. Each episode asks an updated key (``prompt``; gold ``newest``, the
    superseded value ``oldest``) and a key the later turn left alone (``kept_prompt``, ``kept``)."""
    rng = random.Random(seed)
    episodes = []
    for _ in range(num_episodes):
        keys = rng.sample(range(NUM_KEYS), first)
        old = [rng.randrange(NUM_VALUES) for _ in keys]
        again = rng.sample(range(first), updated)
        new = {i: rng.choice([v for v in range(NUM_VALUES) if v != old[i]]) for i in again}
        asked = rng.choice(again)
        kept = rng.choice([i for i in range(first) if i not in again])
        episodes.append(
            {
                "turns": [
                    " ".join(f"k{k:02d} v{v:02d} ;" for k, v in zip(keys, old, strict=True)),
                    " ".join(f"k{keys[i]:02d} v{new[i]:02d} ;" for i in again),
                ],
                "prompt": f"? k{keys[asked]:02d}",
                "newest": f" v{new[asked]:02d}",
                "oldest": f" v{old[asked]:02d}",
                "kept_prompt": f"? k{keys[kept]:02d}",
                "kept": f" v{old[kept]:02d}",
            }
        )
    return episodes


class feedback_off:
    """Within this block, ``model``'s adapter writes without block-end feedback (same weights)."""

    def __init__(self, model):
        self.config = next(iter(model.peft_config.values()))

    def __enter__(self):
        self.was, self.config.block_feedback = self.config.block_feedback, False

    def __exit__(self, *exc):
        self.config.block_feedback = self.was


@torch.no_grad()
def evaluate_updates(model, tokenizer=None, num_episodes: int = 512, seed: int = UPDATE_SEED) -> dict:
    """Recall after an update: the first turn is written (one block, feedback after it), then the
    later turn (another block, feedback after it), then each question alone reads the memory.

    ``update_newest``: an updated key answered with its newest value (gold). ``update_oldest``: the
    same question answered with the superseded value. ``update_kept``: a key the later turn left
    alone, answered with its value.
    """
    tok = tokenizer or demo_tokenizer()
    pad = _pad_id(tok)
    episodes = update_episodes(num_episodes, seed=seed)
    cache = MemoryCache()
    for turn in range(2):
        rows = [tok(e["turns"][turn], add_special_tokens=False)["input_ids"] for e in episodes]
        if turn == 0 and tok.bos_token_id is not None:
            rows = [[tok.bos_token_id] + r for r in rows]
        ids, mask = left_pad(rows, pad)
        write_history(model, ids, cache, attention_mask=mask, progress=False)

    def recall(prompt: str, answer: str) -> float:
        rows = [
            tokenize_episode(tok, {"history": "", "prompt": e[prompt], "answer": e[answer]}, add_eos=False)
            for e in episodes
        ]
        n_ans = [sum(1 for y in r["labels"] if y != -100) for r in rows]
        return _correct(model, tok, [r["input_ids"] for r in rows], n_ans, cache).float().mean().item()

    return {
        "update_newest": recall("prompt", "newest"),
        "update_oldest": recall("prompt", "oldest"),
        "update_kept": recall("kept_prompt", "kept"),
        "num_episodes": num_episodes,
    }


def build(
    out: Path = DEMO_ASSETS, warm_steps: int = 800, pretrain_steps: int = 1260, adapter_steps: int = 600
) -> dict:
    """Remake the shipped backbone and adapters; writes and returns the timings and evaluations."""
    out.mkdir(parents=True, exist_ok=True)
    record = {}
    start = time.perf_counter()
    backbone = pretrain_backbone(warm_steps=warm_steps, steps=pretrain_steps)
    record["pretrain_backbone_s"] = round(time.perf_counter() - start, 1)
    backbone.save_pretrained(out / "backbone")
    for name, overrides in ADAPTERS.items():
        start = time.perf_counter()
        model, _ = train_adapter(load_backbone(out), overrides, max_steps=adapter_steps)
        record[f"train_adapter_{name}_s"] = round(time.perf_counter() - start, 1)
        model.save_pretrained(out / f"adapter_{name}")
        record[f"eval_{name}"] = evaluate(model)
    (out / "build.json").write_text(json.dumps(record, indent=2) + "\n")
    publish(out)
    return record


#: What the shipped adapters name as their base model: the backbone folder inside this package
#: (never the temporary folder of the machine that built them).
DEMO_BACKBONE = "lstmem_peft/assets/demo/backbone"


def publish(folder: Path = DEMO_ASSETS) -> None:
    """Re-save the demo adapters in ``folder`` as they ship: the package-relative base model name, a
    fixed ``memory_id`` (so saved memory stays valid across loads), and a model card with their
    settings, how they were trained and evaluated (``build.json``) and the citation. The weights are
    unchanged."""
    import tempfile

    from huggingface_hub import ModelCard
    from peft import PeftModel

    from lstmem_peft.training.card import record_training, write_model_card

    record = json.loads((folder / "build.json").read_text())
    for name in ADAPTERS:
        target = folder / f"adapter_{name}"
        model = PeftModel.from_pretrained(load_backbone(folder), target)
        config = model.peft_config["default"]
        config.base_model_name_or_path = DEMO_BACKBONE
        config.memory_id = f"lstmem-demo-{name}"
        recall = record.get(f"eval_{name}", {})
        record_training(
            model,
            base_model=f"the demo backbone ({DEMO_BACKBONE}), pretrained by `lstmem_peft.cli.demo.build`",
            training_data="synthetic key-value recall episodes (lstmem_peft.training.data.synthetic_recall_episodes)",
            updates=600,
            built=f"{record.get('date', 'unknown date')}, {record.get('machine', 'machine not recorded')}",
            recall_from_memory=recall.get("recall_memory"),
            recall_in_context=recall.get("recall_in_context"),
            recall_no_history=recall.get("recall_no_history"),
        )
        model.get_base_model().config._name_or_path = DEMO_BACKBONE  # the card's base_model
        with tempfile.TemporaryDirectory() as staging:  # a fresh card, not the one already there
            intro = (
                f"# LSTMem demo adapter: {name.replace('_', ' ')}\n\n"
                "Shipped with lstmem-peft for `lstmem demo`: a tiny adapter on the package's tiny demo "
                "backbone, trained to recall key-value pairs written into memory "
                f"({'the full method' if not ADAPTERS[name] else 'ablation ' + json.dumps(ADAPTERS[name])}). "
                "It is a working example of the method and the file format, not a model for real text.\n\n"
            )
            (Path(staging) / "README.md").write_text(intro)
            model.save_pretrained(staging)  # PEFT adds its metadata to the card it finds
            write_model_card(model, staging)
            card = ModelCard.load(Path(staging) / "README.md")  # no tag may name the builder's folder
            card.data["tags"] = [t for t in card.data.get("tags", []) if not t.startswith("base_model:")]
            card.save(Path(staging) / "README.md")
            for file in ("README.md", "adapter_config.json", "adapter_model.safetensors"):
                (target / file).write_bytes((Path(staging) / file).read_bytes())


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["build"]:
        print(json.dumps(build(), indent=2))
    elif sys.argv[1:2] == ["publish"]:
        publish()


# ---------------------------------------------------------------------- the `lstmem demo` command
def format_table(results: dict[str, dict]) -> str:
    """Rows: the full adapter and ablations; columns: the three conditions and the reference levels."""
    header = (
        f"{'adapter':<20}{'in context':>12}{'no history':>12}{'memory only':>13}{'chance':>9}{'1/pairs':>9}"
    )
    lines = [header, "-" * len(header)]
    for name, r in results.items():
        lines.append(
            f"{name:<20}{r['recall_in_context']:>12.3f}{r['recall_no_history']:>12.3f}{r['recall_memory']:>13.3f}"
            f"{r['chance']:>9.3f}{r['bag_of_values']:>9.3f}"
        )
    return "\n".join(lines)


def format_updates(results: dict[str, dict]) -> str:
    """Rows: adapters; columns: after an update, the newest value, the superseded one, a kept key."""
    n = next(iter(results.values()))["num_episodes"]
    head = f"{'after an update (memory only)':<36}{'newest value':>14}{'old value':>11}{'untouched key':>15}"
    lines = [
        f"Updates: {NUM_PAIRS} facts in one turn, then a later turn gives 4 of the keys new values "
        f"({n} episodes); asked: an updated key (gold: the newest value) or a key left alone.",
        head,
        "-" * len(head),
    ]
    for name, r in results.items():
        lines.append(
            f"{name:<36}{r['update_newest']:>14.3f}{r['update_oldest']:>11.3f}{r['update_kept']:>15.3f}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------- past the window: the sweep
#: The demo backbone's context window, in tokens (question included). Its config allows 4,096
#: positions, but it was only ever trained on sequences of up to 50 tokens: with the whole history
#: in context its recall is 0.996 at 16 facts (51 tokens with the question), 0.600 at 32 facts and
#: 0.043 at 64 (``lstmem demo --sweep``, 2026-11-25). 64 tokens (the question and the last 20
#: facts) is where it still works, and it is also the adapters' block size.
WINDOW = 64
#: History lengths of the sweep, in facts: one block (8 facts, 25 tokens) to 13 (256 facts, 769 tokens).
SWEEP_FACTS = (8, 16, 32, 64, 128, 256)
#: Bucket edges for recall against a fact's age (facts written after it).
AGE_EDGES = (0, 4, 8, 16, 32, 64, 128, 256)


def _rows(tok, episodes: list[dict]) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """``(histories, reads, answer lengths)``; a read is the question followed by its answer."""
    rows = [tokenize_episode(tok, e, history_max_tokens=1 << 30, add_eos=False) for e in episodes]
    n_ans = [sum(1 for y in r["labels"] if y != -100) for r in rows]
    return [r["history_input_ids"] for r in rows], [r["input_ids"] for r in rows], n_ans


def in_context_row(tok, history: list[int], read: list[int]) -> list[int]:
    """The whole history, then the question and answer (one BOS)."""
    return history + (read[1:] if tok.bos_token_id is not None else read)


def window_row(tok, history: list[int], read: list[int], n_answer: int, window: int = WINDOW) -> list[int]:
    """What the plain backbone sees when the context is capped: the last tokens of history and
    question that fit in ``window`` (the question always fits), BOS kept first; then the answer."""
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    question = read[len(bos) : len(read) - n_answer]
    body = history[len(bos) :]
    room = max(0, window - len(bos) - len(question))
    return bos + (body[max(0, len(body) - room) :] if room else []) + question + read[len(read) - n_answer :]


def _pad_id(tok) -> int:
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def _correct(model, tok, rows, n_ans, cache=None, batch_tokens: int = 1 << 14) -> torch.Tensor:
    """Per row: is the answer right (exact match, teacher-forced argmax)? Rows batched by length."""
    width = max(len(r) for r in rows)
    step = max(1, batch_tokens // width)
    out = []
    for i in range(0, len(rows), step):
        part = None
        if cache is not None:
            part = cache.clone()
            part.batch_select_indices(torch.arange(i, min(i + step, len(rows))))
        out.append(_answers_correct(model, rows[i : i + step], n_ans[i : i + step], _pad_id(tok), part))
    return torch.cat(out)


def _write(model, tok, histories: list[list[int]]) -> MemoryCache:
    cache = MemoryCache()
    ids, mask = left_pad(histories, _pad_id(tok))
    write_history(model, ids, cache, attention_mask=mask, progress=False)
    return cache


def cell_statistics(cache: MemoryCache) -> list[dict]:
    """Per memory layer: the RMS of the cell ``C`` and the share of its entries with ``|C| > 2``,
    where ``tanh`` (which ``D = o * tanh(C) + g * D_below`` expresses) is saturated (slope < 0.07)."""
    return [
        {
            "cell_rms": layer.cell.double().pow(2).mean().sqrt().item(),
            "cell_saturated": (layer.cell.abs() > 2).double().mean().item(),
        }
        for layer in cache.layers
    ]


@torch.no_grad()
def recall_conditions(
    models: dict,
    tok,
    episodes: list[dict],
    window: int = WINDOW,
    batch_size: int = 64,
    cells: list | None = None,
) -> dict[str, torch.Tensor]:
    """Per-episode exact-match correctness under every condition of the sweep.

    ``memory/<name>``: the whole history written into that adapter's memory (blocks of its
    ``block_size``, feedback after each), then the question alone. ``memory+window``: the full
    adapter's memory and the window in context (LSTMem as the paper evaluates it; the shipped
    adapters were trained memory-only). ``window``: the plain backbone with history and question
    cut to the last ``window`` tokens (what a user gets without memory). ``in_context``: the plain
    backbone with the whole history in context, window or not. ``no_history``: the question alone.
    ``cells``: if given, receives ``(rows, cell_statistics)`` of the full adapter's memory per batch.
    """
    histories, reads, n_ans = _rows(tok, episodes)
    windowed = [window_row(tok, h, r, n, window) for h, r, n in zip(histories, reads, n_ans, strict=True)]
    whole = [in_context_row(tok, h, r) for h, r in zip(histories, reads, strict=True)]
    plain = next(iter(models.values()))
    hits: dict[str, list[torch.Tensor]] = {}

    def add(key, value):
        hits.setdefault(key, []).append(value)

    for i in range(0, len(episodes), batch_size):
        chunk = slice(i, i + batch_size)
        for name, model in models.items():
            cache = _write(model, tok, histories[chunk])
            add(f"memory/{name}", _correct(model, tok, reads[chunk], n_ans[chunk], cache))
            if name == "full":
                add("memory+window", _correct(model, tok, windowed[chunk], n_ans[chunk], cache))
                if cells is not None:
                    cells.append((len(histories[chunk]), cell_statistics(cache)))
        with plain.disable_adapter():
            add("window", _correct(plain, tok, windowed[chunk], n_ans[chunk]))
            add("in_context", _correct(plain, tok, whole[chunk], n_ans[chunk]))
            add("no_history", _correct(plain, tok, reads[chunk], n_ans[chunk]))
    return {k: torch.cat(v) for k, v in hits.items()}


def memory_state_size(model) -> dict:
    """How many numbers the memory holds per sequence: ``n_h * r * r`` per state (C and D) and layer."""
    config = next(iter(model.peft_config.values()))
    layers = len(memory_layers(model))
    per_state = config.num_heads * config.r * config.r
    return {
        "memory_layers": layers,
        "num_heads": config.num_heads,
        "r": config.r,
        "cell_numbers_per_layer": per_state,
        "cell_numbers_total": per_state * layers,
        "state_numbers_total": 2 * per_state * layers,
        "block_size": config.block_size,
        "block_feedback": config.block_feedback,
        "depth_coupling": config.depth_coupling,
    }


@torch.no_grad()
def sweep(
    models: dict,
    tokenizer=None,
    facts=SWEEP_FACTS,
    num_episodes: int = 256,
    window: int = WINDOW,
    seed: int = 2024,
    progress: bool = False,
) -> dict:
    """Recall against history length, from one block of facts to many, with the window marked.

    Histories come from :func:`~lstmem_peft.training.data.long_recall_episodes` (the asked key appears once,
    anywhere in the history). Returns a JSON-ready record: per length, recall under every condition
    of :func:`recall_conditions`, recall by the asked fact's age, and the sizes that bound it.
    """
    tok = tokenizer or demo_tokenizer()
    full = models.get("full", next(iter(models.values())))
    block = memory_state_size(full)["block_size"]
    one, two = (_rows(tok, long_recall_episodes(1, n))[0][0] for n in (1, 2))
    _, reads, n_ans = _rows(tok, long_recall_episodes(1, 1))
    question = len(reads[0]) - n_ans[0]
    window_facts = (window - question) // (len(two) - len(one))  # whole facts beside the question
    edges = sorted(set(AGE_EDGES) | {window_facts})
    rows = []
    start = time.perf_counter()
    for n in tqdm(facts, desc="sweep", disable=not progress):
        episodes = long_recall_episodes(num_episodes, n, NUM_KEYS, NUM_VALUES, seed=seed + n)
        histories, reads, n_ans = _rows(tok, episodes)
        cells: list = []
        hits = recall_conditions(models, tok, episodes, window, cells=cells)
        total = sum(n for n, _ in cells)
        state = [
            {
                "cell_rms": round((sum(n * c[i]["cell_rms"] ** 2 for n, c in cells) / total) ** 0.5, 3),
                "cell_saturated": round(sum(n * c[i]["cell_saturated"] for n, c in cells) / total, 4),
            }
            for i in range(len(cells[0][1]) if cells else 0)
        ]
        ages = torch.tensor([e["facts_after"] for e in episodes])
        context = max(len(h) for h in histories) + len(reads[0]) - n_ans[0] - (tok.bos_token_id is not None)
        by_age = []
        for lo, hi in zip(edges, edges[1:], strict=False):
            pick = (ages >= lo) & (ages < hi)
            if int(pick.sum()):
                by_age.append(
                    {
                        "facts_after": [lo, hi - 1],
                        "episodes": int(pick.sum()),
                        **{k: round(v[pick].float().mean().item(), 4) for k, v in hits.items()},
                    }
                )
        rows.append(
            {
                "facts": n,
                "history_tokens": max(len(h) for h in histories),
                "context_tokens": context,
                "blocks": -(-max(len(h) for h in histories) // block),
                "fits_window": context <= window,
                "recall": {k: round(v.float().mean().item(), 4) for k, v in hits.items()},
                "by_age": by_age,
                "full_adapter_cells": state,
            }
        )
    return {
        "benchmark": "demo-sweep",
        "window_tokens": window,
        "window_facts": window_facts,
        "num_episodes": num_episodes,
        "num_keys": NUM_KEYS,
        "num_values": NUM_VALUES,
        "chance": 1 / NUM_VALUES,
        "seed": seed,
        "adapters": {name: memory_state_size(m) for name, m in models.items()},
        "rows": rows,
        "seconds": round(time.perf_counter() - start, 1),
    }


def format_sweep(record: dict) -> str:
    """One row per history length: the conditions' recall, '-' where the history does not fit."""
    names = [k for k in record["rows"][0]["recall"] if k.startswith("memory/")]
    head = f"{'facts':>6}{'tokens':>8}{'blocks':>7}" + "".join(f"{n[7:][:17]:>18}" for n in names)
    head += f"{'memory+window':>15}{'window':>8}{'in context':>12}{'no history':>12}"
    lines = [head, "-" * len(head)]
    for row in record["rows"]:
        r = row["recall"]
        ctx = f"{r['in_context']:.3f}" if row["fits_window"] else f"({r['in_context']:.3f})"
        lines.append(
            f"{row['facts']:>6}{row['history_tokens']:>8}{row['blocks']:>7}"
            + "".join(f"{r[n]:>18.3f}" for n in names)
            + f"{r['memory+window']:>15.3f}{r['window']:>8.3f}{ctx:>12}{r['no_history']:>12.3f}"
        )
    if record["rows"][0].get("full_adapter_cells"):
        lines.append(
            "full adapter's cells after writing, per memory layer (RMS of C, share of |C| > 2 where tanh "
            "saturates): "
            + "; ".join(
                f"{row['facts']} facts "
                + " ".join(
                    f"{c['cell_rms']:.1f}/{c['cell_saturated']:.2f}" for c in row["full_adapter_cells"]
                )
                for row in record["rows"]
            )
        )
    full = record["adapters"].get("full") or next(iter(record["adapters"].values()))
    lines.append(
        f"window: {record['window_tokens']} tokens (the question and the last {record['window_facts']} facts); "
        "(in context) past the window: the whole history given anyway. Memory: "
        f"{full['memory_layers']} layers x n_h {full['num_heads']} x r {full['r']}^2 = "
        f"{full['cell_numbers_total']} cell numbers (+ as many in D) per sequence; chance {record['chance']:.3f}."
    )
    return "\n".join(lines)


def plot_sweep(record: dict, path: str | Path) -> Path | None:
    """Two panels: recall against history length (window marked) and against the asked fact's age
    in the longest history. Returns the PNG path, or ``None`` (with a message) without matplotlib."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        print("matplotlib is not installed: no plot (pip install 'lstmem-peft[bench]')")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = record["rows"]
    facts = [r["facts"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12.5, 6))
    style = {
        "full": ("C0", "-", 2.4),
        "no_depth_coupling": ("C4", "--", 1.2),
        "no_feedback": ("C2", ":", 1.4),
    }
    for key in rows[0]["recall"]:
        if key.startswith("memory/"):
            color, line, width = style.get(key[7:], ("C5", "-", 1.2))
            left.plot(
                facts,
                [r["recall"][key] for r in rows],
                "o",
                ls=line,
                lw=width,
                color=color,
                label=f"LSTMem memory only ({key[7:].replace('_', ' ')})",
            )
    left.plot(
        facts,
        [r["recall"]["memory+window"] for r in rows],
        "^-",
        color="C9",
        lw=1.2,
        label="LSTMem memory + window in context",
    )
    left.plot(
        facts,
        [r["recall"]["window"] for r in rows],
        "s-",
        color="C1",
        lw=2,
        label=f"plain backbone, history cut to its {record['window_tokens']}-token window",
    )
    fits = [r for r in rows if r["fits_window"]]
    left.plot(
        [r["facts"] for r in fits],
        [r["recall"]["in_context"] for r in fits],
        "D-",
        color="k",
        label="plain backbone, whole history in context (fits)",
    )
    left.plot(
        facts,
        [r["recall"]["in_context"] for r in rows],
        ":",
        color="0.6",
        label="whole history in context, past the window",
    )
    left.plot(facts, [r["recall"]["no_history"] for r in rows], "x-", color="C3", label="no history")
    left.axhline(record["chance"], color="0.75", lw=0.8)
    left.axvline(record["window_facts"], color="C1", ls="--", lw=1)
    left.text(record["window_facts"] * 1.04, 0.97, "window", color="C1", va="top")
    left.set_xscale("log", base=2)
    left.set_xticks(facts, [str(f) for f in facts])
    left.set_xlabel("facts in the history (3 tokens each)")
    left.set_ylabel("recall (exact match)")
    left.set_ylim(-0.02, 1.02)
    left.set_title("Recall against history length")
    left.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    # the age panel: the first history that outgrows the window by half again (32 facts here), where
    # the memory still recalls something, so old facts show whether it holds what the window lost
    past = [r for r in rows if r["facts"] * 2 >= 3 * record["window_facts"]]
    chosen = past[0] if past else rows[-1]
    buckets = chosen["by_age"]
    where = range(len(buckets))
    names = {
        "memory/full": ("C0", "o", "LSTMem memory only (full)"),
        "memory/no_depth_coupling": ("C4", "o", "memory only, no depth coupling"),
        "memory/no_feedback": ("C2", "o", "memory only, no feedback"),
        "window": ("C1", "s", "plain backbone, cut to the window"),
        "memory+window": ("C9", "^", "LSTMem memory + window"),
    }
    for key, (color, marker, label) in names.items():
        if key in buckets[0]:
            width = 2.2 if key in ("memory/full", "window") else 1.0
            right.plot(where, [b[key] for b in buckets], marker + "-", color=color, lw=width, label=label)
    right.set_xticks(list(where), [f"{b['facts_after'][0]}-{b['facts_after'][1]}" for b in buckets])
    edge = next((i for i, b in enumerate(buckets) if b["facts_after"][0] >= record["window_facts"]), None)
    if edge is not None:
        right.axvline(edge - 0.5, color="C1", ls="--", lw=1)
        right.text(edge - 0.45, 0.97, "past the window", color="C1", va="top", fontsize=8)
    right.axhline(record["chance"], color="0.75", lw=0.8)
    right.set_xlabel(f"facts written after the asked one ({chosen['facts']}-fact histories)")
    right.set_ylim(-0.02, 1.02)
    right.set_title("Recall against the fact's age")
    right.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    full = record["adapters"].get("full") or next(iter(record["adapters"].values()))
    fig.suptitle(
        f"lstmem demo --sweep: {record['num_episodes']} episodes per length; memory "
        f"{full['memory_layers']} layers x {full['num_heads']} heads x {full['r']}x{full['r']} cells "
        f"({full['cell_numbers_total']} numbers); {record.get('device', '')} {record.get('date', '')[:10]}",
        fontsize=9,
    )
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# ---------------------------------------------------------------------- episodes a person can read
def _abridge(facts: list[str], asked: int, keep: int = 2) -> str:
    """The history's facts with the asked one in brackets; long runs elided as '... (n facts) ...'."""
    if len(facts) <= 10:
        keep = len(facts)
    show = set(range(min(keep, len(facts)))) | set(range(max(0, len(facts) - keep), len(facts)))
    show |= {asked - 1, asked, asked + 1}
    parts, skipped = [], 0
    for i, fact in enumerate(facts):
        if i not in show:
            skipped += 1
            continue
        if skipped:
            parts.append(f"... ({skipped} facts) ...")
            skipped = 0
        parts.append(f"[{fact}]" if i == asked else fact)
    return " ".join(parts)


@torch.no_grad()
def show_episodes(
    model, tokenizer=None, num: int = 3, num_facts: int = NUM_PAIRS, window: int = WINDOW, seed: int = 777
) -> list[dict]:
    """Episodes a person can read: history (abridged), question, gold, and the answers from memory,
    with no history and (when the history is longer than the window) from the cut window."""
    tok = tokenizer or demo_tokenizer()
    episodes = long_recall_episodes(num, num_facts, NUM_KEYS, NUM_VALUES, seed=seed)
    histories, reads, n_ans = _rows(tok, episodes)
    cache = _write(model, tok, histories)
    pad = _pad_id(tok)
    block = memory_state_size(model)["block_size"]

    def answers(rows, with_cache=None):
        ids, mask = left_pad(rows, pad)
        kwargs = dict(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0))
        if with_cache is None:
            logits = model(**kwargs).logits
        else:
            logits = model(**kwargs, memory_cache=with_cache, memory_write=False).logits
        probs = logits[:, :-1].softmax(-1)
        out = []
        for i, n in enumerate(n_ans):
            p, ids_ = probs[i, -n:].max(-1)
            out.append((tok.decode(ids_.tolist()).strip(), round(float(p.prod()), 3)))
        return out

    memory = answers(reads, cache)
    with model.disable_adapter():
        none = answers(reads)
        windowed = [window_row(tok, h, r, n, window) for h, r, n in zip(histories, reads, n_ans, strict=True)]
        cut = answers(windowed)
    shown = []
    for i, e in enumerate(episodes):
        facts = [f.strip() + " ;" for f in e["history"].split(";") if f.strip()]
        gold = e["answer"].strip()
        shown.append(
            {
                "history": _abridge(facts, len(facts) - 1 - e["facts_after"]),
                "pairs": [tuple(f.split()[:2]) for f in facts],
                "facts": len(facts),
                "history_tokens": len(histories[i]),
                "blocks": -(-len(histories[i]) // block),
                "facts_after": e["facts_after"],
                "question": e["prompt"],
                "gold": gold,
                "memory": memory[i][0],
                "memory_p": memory[i][1],
                "no_history": none[i][0],
                "no_history_p": none[i][1],
                "window": cut[i][0],
                "window_p": cut[i][1],
                "fits_window": len(in_context_row(tok, histories[i], reads[i])) - n_ans[i] <= window,
            }
        )
    return shown


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def format_episodes(shown: list[dict], window: int = WINDOW) -> str:
    """The episodes of :func:`show_episodes` as text; a wrong answer that is another fact's value
    says whose (the memory bound the wrong key) or that it was never in the history."""

    def mark(e, key):
        answer = e[key]
        if answer == e["gold"]:
            return "right"
        owners = sorted({k for k, v in e.get("pairs", []) if v == answer})
        if owners:
            return f"wrong (the value of {', '.join(owners)} in the history)"
        return "wrong (not a value in the history)" if e.get("pairs") else "wrong"

    lines = []
    for i, e in enumerate(shown, 1):
        lines += [
            f"episode {i}: {_plural(e['facts'], 'fact')}, {e['history_tokens']} tokens written into memory in "
            f"{_plural(e['blocks'], 'block')} with feedback after each; the asked fact [in brackets] has "
            f"{_plural(e['facts_after'], 'fact')} after it",
            f"  history     {e['history']}",
            f"  question    {e['question']}   (the history is gone from the context)",
            f"  gold        {e['gold']}",
            f"  memory      {e['memory']}  p={e['memory_p']:.2f}  LSTMem memory only: {mark(e, 'memory')}",
            f"  no history  {e['no_history']}  p={e['no_history_p']:.2f}  plain backbone, question alone: "
            f"{mark(e, 'no_history')}",
        ]
        if not e["fits_window"]:
            lines.append(
                f"  window      {e['window']}  p={e['window_p']:.2f}  plain backbone, history cut to its "
                f"{window}-token window: {mark(e, 'window')}"
            )
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------- the command
def _load_models(names, train, model_id, train_steps, seed):
    timings, models, tokenizer = {}, {}, None
    if model_id is not None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_id)
        load = lambda: AutoModelForCausalLM.from_pretrained(model_id).eval()  # noqa: E731
        if not train:
            print("no trained adapter ships for this model: pass --train to train one first")
    else:
        load = load_backbone
    for name in names:
        if train:
            start = time.perf_counter()
            model, _ = train_adapter(
                load(), ADAPTERS[name], max_steps=train_steps, seed=seed, tokenizer=tokenizer
            )
            timings[f"train_{name}_s"] = round(time.perf_counter() - start, 1)
            print(f"trained adapter '{name}' in {timings[f'train_{name}_s']} s")
        elif model_id is None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(load(), DEMO_ASSETS / f"adapter_{name}").eval()
        else:
            from peft import get_peft_model

            model = get_peft_model(load(), adapter_config(**ADAPTERS[name])).eval()
        models[name] = model
    return models, tokenizer, timings


def run_sweep(
    models: dict,
    tokenizer=None,
    out: str | Path = ".",
    facts=SWEEP_FACTS,
    num_episodes: int = 256,
    window: int = WINDOW,
    command: str = "lstmem demo --sweep",
) -> dict:
    """The sweep, its table, and its record (``demo-sweep-<stamp>.json``) and plot (``.png``) in ``out``."""
    from .bench import environment

    env = environment(torch.device("cpu"))
    record = sweep(models, tokenizer, facts=facts, num_episodes=num_episodes, window=window, progress=True)
    record.update(env, command=command, threads=torch.get_num_threads())
    print(format_sweep(record))
    stamp = env["date"].replace(":", "").replace("-", "")[:15]
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"demo-sweep-{stamp}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    png = plot_sweep(record, path.with_suffix(".png"))
    return {"record": str(path), "plot": str(png) if png else None, "seconds": record["seconds"]}


def run(
    train: bool = False,
    model_id: str | None = None,
    num_episodes: int = 512,
    ablations: bool = True,
    train_steps: int = 600,
    seed: int = 42,
    show: int = 0,
    show_facts: int = NUM_PAIRS,
    sweep_facts=None,
    window: int = WINDOW,
    out: str | Path = ".",
) -> dict:
    """What ``lstmem demo`` does; returns the summary printed as the last line.

    ``show``: first print that many episodes (``show_facts`` facts each). ``sweep_facts``: instead
    of the 8-fact table, run the history-length sweep over these lengths (``num_episodes`` each)
    and write its record and plot into ``out``.
    """
    threads = torch.get_num_threads()
    if model_id is None and not train:
        # the embedded model is tiny (hidden 128): more threads only add synchronisation, and on a
        # busy 2-core machine two threads wrote 256-fact histories 15 times slower than one
        torch.set_num_threads(1)
    try:
        return _run(
            train,
            model_id,
            num_episodes,
            ablations,
            train_steps,
            seed,
            show,
            show_facts,
            sweep_facts,
            window,
            out,
        )
    finally:
        torch.set_num_threads(threads)


def _run(
    train, model_id, num_episodes, ablations, train_steps, seed, show, show_facts, sweep_facts, window, out
):
    names = list(ADAPTERS) if ablations else ["full"]
    models, tokenizer, timings = _load_models(names, train, model_id, train_steps, seed)
    if show:
        print(format_episodes(show_episodes(models["full"], tokenizer, show, show_facts, window), window))
    if sweep_facts:
        written = run_sweep(models, tokenizer, out, sweep_facts, num_episodes, window)
        summary = {"sweep": written, "trained": train, **timings}
        print(json.dumps(summary))
        return summary
    results = {
        name: evaluate(model, tokenizer, num_episodes=num_episodes, progress=True)
        for name, model in models.items()
    }
    print(format_table(results))
    updates = {name: evaluate_updates(model, tokenizer, num_episodes) for name, model in models.items()}
    with feedback_off(models["full"]):
        updates["full, feedback off while writing"] = evaluate_updates(
            models["full"], tokenizer, num_episodes
        )
    print(format_updates(updates))
    full = results["full"]
    summary = {
        "recall_memory": full["recall_memory"],
        "recall_no_history": full["recall_no_history"],
        "recall_in_context": full["recall_in_context"],
        "chance": full["chance"],
        "bag_of_values": full["bag_of_values"],
        "num_pairs": full["num_pairs"],
        "num_episodes": full["num_episodes"],
        "trained": train,
        **{f"recall_memory_{k}": v["recall_memory"] for k, v in results.items() if k != "full"},
        "update_newest": updates["full"]["update_newest"],
        "update_oldest": updates["full"]["update_oldest"],
        "update_kept": updates["full"]["update_kept"],
        "update_newest_feedback_off_while_writing": updates["full, feedback off while writing"][
            "update_newest"
        ],
        **{
            f"update_newest_{k}": v["update_newest"]
            for k, v in updates.items()
            if k in ADAPTERS and k != "full"
        },
        **timings,
    }
    print(json.dumps(summary))
    return summary
