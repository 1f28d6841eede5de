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
trained by :class:`~lstmem_peft.trainer.LSTMemTrainer` on histories of 1 to 8 facts (8 facts only
stayed at the 1/num_pairs plateau). ``python -m lstmem_peft.demo build`` remakes the shipped files
and records its timings and scores in ``assets/demo/build.json``.
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
from tokenizers import Tokenizer, models, pre_tokenizers
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

from .cache import MemoryCache
from .config import LSTMemConfig
from .data import left_pad, synthetic_recall_episodes, tokenize_episode
from .history import memory_layers, write_history
from .offline import tiny_qwen3

ASSETS = Path(__file__).parent / "assets" / "demo"
NUM_KEYS = NUM_VALUES = 32
NUM_PAIRS = 8
ADAPTERS = {
    "full": {},
    "no_depth_coupling": {"depth_coupling": False},
    "no_feedback": {"block_feedback": False},
}


def demo_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer: ``<pad> <s> </s> ; ?``, keys ``k00..k31``, values ``v00..v31``."""
    words = (
        ["<pad>", "<s>", "</s>", ";", "?"]
        + [f"k{i:02d}" for i in range(NUM_KEYS)]
        + [f"v{i:02d}" for i in range(NUM_VALUES)]
    )
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", padding_side="left"
    )


def adapter_config(**overrides) -> LSTMemConfig:
    """The paper's adapter (n_h 4, r 8, alpha 16) on every layer; one block per demo history."""
    return LSTMemConfig(r=8, num_heads=4, alpha=16.0, block_size=64, **overrides)


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
):
    """Train a fresh adapter on the frozen backbone with :class:`LSTMemTrainer`; returns the PEFT model."""
    from peft import get_peft_model

    from .extras import missing_extra
    from .trainer import LSTMemTrainer, LSTMemTrainingConfig

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
    per_count = max_steps * batch_size // NUM_PAIRS + 1
    episodes = [
        e for n in range(1, NUM_PAIRS + 1) for e in synthetic_recall_episodes(per_count, n, seed=seed + n)
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


def load_backbone(path: Path = ASSETS) -> Qwen3ForCausalLM:
    if not (path / "backbone" / "config.json").exists():
        raise FileNotFoundError(
            f"the demo backbone is missing from {path}; rebuild it with `python -m lstmem_peft.demo build`"
        )
    return Qwen3ForCausalLM.from_pretrained(path / "backbone").eval()


def build(
    out: Path = ASSETS, warm_steps: int = 800, pretrain_steps: int = 1260, adapter_steps: int = 600
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


def publish(folder: Path = ASSETS) -> None:
    """Re-save the demo adapters in ``folder`` as they ship: the package-relative base model name, a
    fixed ``memory_id`` (so saved memory stays valid across loads), and a model card with their
    settings, how they were trained and evaluated (``build.json``) and the citation. The weights are
    unchanged."""
    import tempfile

    from huggingface_hub import ModelCard
    from peft import PeftModel

    from .card import record_training, write_model_card

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
            base_model=f"the demo backbone ({DEMO_BACKBONE}), pretrained by `lstmem_peft.demo.build`",
            training_data="synthetic key-value recall episodes (lstmem_peft.data.synthetic_recall_episodes)",
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


def run(
    train: bool = False,
    model_id: str | None = None,
    num_episodes: int = 512,
    ablations: bool = True,
    train_steps: int = 600,
    seed: int = 42,
) -> dict:
    """What ``lstmem demo`` does; returns the summary printed as the last line."""
    timings = {}
    tokenizer = None
    if model_id is not None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_id)
        load = lambda: AutoModelForCausalLM.from_pretrained(model_id).eval()  # noqa: E731
        if not train:
            print("no trained adapter ships for this model: pass --train to train one first")
    else:
        load = load_backbone
    names = list(ADAPTERS) if ablations else ["full"]
    results = {}
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

            model = PeftModel.from_pretrained(load(), ASSETS / f"adapter_{name}").eval()
        else:
            from peft import get_peft_model

            model = get_peft_model(load(), adapter_config(**ADAPTERS[name])).eval()
        results[name] = evaluate(model, tokenizer, num_episodes=num_episodes, progress=True)
    print(format_table(results))
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
        **timings,
    }
    print(json.dumps(summary))
    return summary
