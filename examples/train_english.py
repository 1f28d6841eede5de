"""Train an LSTMem adapter on English memory episodes for a real chat model (issue 45), on a CPU.

    python examples/train_english.py --output-dir /tmp/english-adapter --steps 300
    python examples/train_english.py --output-dir /tmp/english-adapter --steps 600   # resumes at 300
    python examples/train_english.py --output-dir /tmp/english-adapter --eval-only   # score last.pt

Each step draws a fresh batch of ``english_episodes`` (train split; the knobs of the curriculum stage
the step is in), writes each history into a fresh memory with gradients through the writes (stage 1)
and reads the gold answer (with ``--choice-weight``: every one of the episode's ``choices``) from it
(by default ``forced_choice``'s ``"text"`` layout: ``"Question: ...\\nAnswer:"``, then the candidate
and EOS; ``--layout`` takes its chat layouts too, ``conversation`` writing each history line as a
chat client's message).
The loss is

* ``answer``: the mean cross-entropy of the gold answer's tokens (EOS included), as the trainer's;
* ``choice`` (weight ``--choice-weight``): a cross-entropy over the episode's choices, each scored by
  the sum of its tokens' log-probabilities, the gold the target. The distractors are values of the
  same kind (in multi-fact histories, the other people's values), so a prior over likely answers
  cannot lower it: only what the memory holds about this history can;
* ``contrast`` (weight ``--contrast-weight``): each gold answer read again from the memory of the
  next episode of the batch; ``-log sigmoid(own - other)`` of the two scores.

What these measured on SmolLM2-135M-Instruct (no binding yet): docs/real-model-training.md.

Every ``--eval-every`` steps it scores held-out episodes (disjoint names, values and sentence forms)
with ``forced_choice`` under ``memory`` and ``empty`` memory and logs both with ``chance`` to
``<output-dir>/log.jsonl``; every ``--save-every`` steps it writes ``<output-dir>/last.pt`` (adapter,
optimizer, step, settings) and a loadable adapter folder ``<output-dir>/adapter`` (``PeftModel.
from_pretrained``). Rerun the same command (a larger ``--steps``) to resume from ``last.pt``.

Why not ``LSTMemTrainer``: the choice and contrast losses need several reads from the memory each
history was written into, or from another episode's (``B`` writes, up to ``sum C_i + B`` reads), and
the data is an endless, step-indexed stream whose stage follows the step; the trainer's
``compute_loss`` scores the gold answer only, over a fixed dataset. The write and the reads here are
the library's own (``write_history``, ``forced_choice.read_scores``), as the trainer and the
forced-choice check call them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import shutil
import time

import torch


def parse_layers(text: str, num_layers: int) -> list[int] | None:
    """``all``, ``12-29``, ``8,12,16`` or ``every2`` -> layer indices (``None``: all)."""
    if text == "all":
        return None
    if text.startswith("every"):
        k = int(text[5:])
        return list(range(k - 1, num_layers, k))
    out: list[int] = []
    for part in text.split(","):
        if "-" in part:
            lo, hi = part.split("-")
            out += list(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    return out


def parse_curriculum(text: str) -> list[tuple[int, tuple[int, int]]]:
    """``0:1-1,150:1-2,300:2-4`` -> [(first step, (min facts, max facts)), ...]."""
    stages = []
    for part in text.split(","):
        step, facts = part.split(":")
        lo, _, hi = facts.partition("-")
        stages.append((int(step), (int(lo), int(hi or lo))))
    return sorted(stages)


def layout_cycle(text: str) -> list[str]:
    """``--layout``: ``text``, ``text,conversation`` or ``mixed`` -> the layouts updates take in turn."""
    from lstmem_peft.eval.forced_choice import LAYOUTS

    layouts = ("text,chat" if text == "mixed" else text).split(",")
    wrong = [layout for layout in layouts if layout not in LAYOUTS]
    if wrong:
        raise ValueError(f"--layout takes {', '.join(LAYOUTS)}, a comma list of them or mixed; got {text!r}")
    return layouts


def stage_at(curriculum, step: int) -> tuple[int, tuple[int, int]]:
    index = max(i for i, (first, _) in enumerate(curriculum) if first <= step)
    return index, curriculum[index][1]


def parse_range(text: str) -> tuple[float, float]:
    """``"1"`` or ``"0-2"`` -> ``(low, high)``."""
    low, _, high = text.partition("-")
    return float(low), float(high or low)


def history_length(text: str | None, seed: int) -> int | None:
    """The chatter-filled length (tokens) of one update's histories, from ``--history-tokens``:
    ``None`` (no filling), a number, or a ``LOW-HIGH`` range drawn from uniformly by update, so every
    history of a batch has about the same length and the batch pads little."""
    if text is None:
        return None
    low, high = (int(x) for x in parse_range(text))
    return random.Random(seed).randint(low, high)


def check_history_tokens(text: str | None) -> None:
    """Refuses a ``--history-tokens`` that is not ``N`` or ``LOW-HIGH`` with ``0 < LOW <= HIGH``."""
    if text is None:
        return
    try:
        low, high = parse_range(text)
    except ValueError:
        low = high = float("nan")
    if not (0 < low <= high) or low != int(low) or high != int(high):
        raise ValueError(
            f"--history-tokens takes a number of tokens or a range LOW-HIGH of them (e.g. 128-768), got {text!r}"
        )


def episode_knobs(
    args,
    facts: tuple[int, int],
    relations: list[str] | None = None,
    held_out: bool = False,
    history_tokens: int | None = None,
    tokenizer=None,
) -> dict:
    """The ``english_episodes`` knobs of a training batch, or of a held-out evaluation
    (``held_out``: ``--eval-chatter`` where given, else the training's ``--chatter``).
    ``history_tokens``: chatter is added until each history reaches that many tokens of ``tokenizer``."""
    if relations is None and args.relations:
        relations = args.relations.split(",")
    chatter = args.eval_chatter if held_out and args.eval_chatter is not None else args.chatter
    return dict(
        relations=relations,
        num_facts=facts,
        chatter=parse_range(chatter),
        history_tokens=history_tokens,
        tokenizer=tokenizer if history_tokens is not None else None,
        updates=0.0,
        same_relation=args.same_relation,
        min_choices=args.min_choices,
        style=args.style,
    )


#: Options a rerun may change; every other setting is the saved run's. The run's folder is where
#: ``last.pt`` was found, not where it was first written (a run copied elsewhere writes there).
RUN_LENGTH = (
    "output_dir",
    "steps",
    "max_minutes",
    "threads",
    "eval_every",
    "save_every",
    "eval_only",
    "no_recall",
    "eval_episodes",
    "eval_facts",
    "eval_chatter",
    "eval_history_tokens",
    "eval_layouts",
    "export",
    "export_dtype",
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output-dir", required=True)
    ap.add_argument(
        "--model", default="smollm2-135m", help="backbone (a short name of `lstmem models`, a folder)"
    )
    ap.add_argument("--steps", type=int, default=300, help="total optimizer steps (resume continues to it)")
    ap.add_argument("--batch", type=int, default=4, help="episodes per step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--layers", default="12-29", help="memory layers: all, 12-29, 8,12,16, every2")
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--choice-weight", type=float, default=0.0, help="weight of the choice cross-entropy")
    ap.add_argument(
        "--answer-weight", type=float, default=1.0, help="weight of the gold-answer cross-entropy"
    )
    ap.add_argument(
        "--contrast-weight",
        type=float,
        default=0.0,
        help="weight of -log sigmoid(gold score from its own history's memory - from the next episode's)",
    )
    ap.add_argument(
        "--near-miss-weight",
        type=float,
        default=0.0,
        help="weight of a cross-entropy of the gold against its near misses (the same digits in "
        "another order, one digit changed: training.english.near_misses), read from its own memory",
    )
    ap.add_argument("--near-misses", type=int, default=3, help="near misses per episode")
    ap.add_argument("--curriculum", default="0:1-1,150:1-2,300:2-4", help="first_step:min-max facts, ...")
    ap.add_argument("--same-relation", type=float, default=1.0)
    ap.add_argument(
        "--relations",
        default="",
        help="comma list of relations to train and evaluate on (e.g. age: values shared by both "
        "splits, names and forms still held out); '': every relation of each split",
    )
    ap.add_argument(
        "--one-relation-per-step",
        action="store_true",
        help="every episode of a step asks the same relation (cycling through them by step), so the "
        "contrast's other history states a value of the same kind",
    )
    ap.add_argument(
        "--step-relations",
        default="",
        help="with --one-relation-per-step, the relations the updates cycle through instead of "
        "--relations: name one several times to train it more often (e.g. extension,room,extension,"
        "price,age); held-out scores still draw evenly from --relations",
    )
    ap.add_argument("--min-choices", type=int, default=4)
    ap.add_argument("--style", default="notes", choices=["notes", "chat", "mixed"])
    ap.add_argument(
        "--layout",
        default="text",
        help="how an episode is laid out (forced_choice's layouts): text (the history written as text, "
        "then Question: ...\\nAnswer:), chat (the question as a user message through the chat template, "
        "as lstmem serve's chat endpoint prompts), conversation (chat, with each history line written "
        "as a chat client's user message); a comma list takes them in turn by update; mixed is text,chat",
    )
    ap.add_argument(
        "--eval-layouts",
        default=None,
        help="comma list of layouts to score (default: every layout of --layout); a run-length option",
    )
    ap.add_argument(
        "--chatter",
        default="0",
        help="lines of chatter per fact in training histories, a number or a range (0-2), placed at random",
    )
    ap.add_argument(
        "--eval-chatter",
        default=None,
        help="lines of chatter per fact in the held-out histories (default: --chatter); a run-length "
        "option, so --eval-only can score a run on histories it was not trained on",
    )
    ap.add_argument(
        "--history-tokens",
        default=None,
        help="fill each training history with more chatter up to this many tokens: a number, or a range "
        "LOW-HIGH drawn from by update (e.g. 128-768), so the memory learns to keep a fact across "
        "the chatter written after it",
    )
    ap.add_argument(
        "--eval-history-tokens",
        type=int,
        default=None,
        help="fill each held-out history with chatter up to this many tokens (default: no filling); "
        "a run-length option",
    )
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-episodes", type=int, default=48)
    ap.add_argument(
        "--eval-facts",
        default="1,2",
        help="held-out facts per history, one eval each: 1,2 or 2-3 ('': the stage's)",
    )
    ap.add_argument(
        "--init-from",
        default=None,
        help="start from another run's adapter weights (its last.pt; same layers, r and heads), with a "
        "fresh optimizer and step count: a curriculum over runs (e.g. ages first, then every number)",
    )
    ap.add_argument("--save-every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (CPUs with AVX512-BF16/AMX)")
    ap.add_argument("--max-minutes", type=float, default=None, help="stop (after a checkpoint) past this")
    ap.add_argument(
        "--eval-only",
        action="store_true",
        help="no training: score last.pt on --eval-episodes held-out episodes per --eval-facts "
        "(forced choice, and greedy recall by normalised match), written to eval.json",
    )
    ap.add_argument("--no-recall", action="store_true", help="--eval-only without the greedy recall")
    ap.add_argument(
        "--export",
        default=None,
        metavar="DIR",
        help="no training: write last.pt's adapter to DIR as a shippable folder (adapter files whose "
        "base_model_name_or_path is --model, not this machine's path; a model card with the run's "
        "settings, updates, time and, when the run folder holds eval.json, its scores)",
    )
    ap.add_argument(
        "--export-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="--export: the dtype the adapter's weights are stored in (loaded into the model's dtype); "
        "bfloat16 halves the file: check that it keeps the scores (--eval-only on a rounded copy)",
    )
    args = ap.parse_args()
    from lstmem_cli.quiet import quiet_command

    quiet_command(loads_models=True)  # what lstmem keeps off the terminal (README "Warnings")
    try:
        layout_cycle(args.layout)
        check_history_tokens(args.history_tokens)
    except ValueError as err:
        ap.error(str(err))
    if args.eval_history_tokens is not None and args.eval_history_tokens < 1:
        ap.error(f"--eval-history-tokens takes a positive number of tokens, got {args.eval_history_tokens}")
    if args.step_relations:
        if not args.one_relation_per_step:
            ap.error("--step-relations names the relation of each update: add --one-relation-per-step")
        unknown = (
            set(args.step_relations.split(",")) - set(args.relations.split(",")) if args.relations else set()
        )
        if unknown:
            ap.error(f"--step-relations names {sorted(unknown)}, which --relations {args.relations} lacks")

    torch.set_num_threads(args.threads)
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from tqdm import tqdm

    from lstmem_peft import LSTMemConfig, MemoryCache, write_history
    from lstmem_peft.eval.english_recall import recall_hit
    from lstmem_peft.eval.forced_choice import choice_rows, forced_choice, read_scores, swap_histories
    from lstmem_peft.training.data import left_pad
    from lstmem_peft.training.english import TRAIN_RELATIONS, english_episodes, near_misses
    from lstmem_peft.tuner.loading import load_model_and_adapter

    os.makedirs(args.output_dir, exist_ok=True)
    last = os.path.join(args.output_dir, "last.pt")
    log_path = os.path.join(args.output_dir, "log.jsonl")
    saved = torch.load(last, map_location="cpu", weights_only=False) if os.path.exists(last) else None
    if saved is not None:  # the run's settings are the saved ones, except how long to run
        keep = {k: v for k, v in saved["args"].items() if k not in RUN_LENGTH}
        vars(args).update(keep)

    base, tokenizer = load_model_and_adapter(args.model, dtype="float32", device="cpu")
    num_layers = base.config.num_hidden_layers
    config = LSTMemConfig(
        r=args.r,
        num_heads=args.heads,
        layers_to_transform=parse_layers(args.layers, num_layers),
        block_size=256,
    )
    if saved is not None:
        config.memory_id = saved["memory_id"]
    model = get_peft_model(base, config)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    step = 0
    if saved is not None:
        set_peft_model_state_dict(model, saved["adapter"])
        optimizer.load_state_dict(saved["optimizer"])
        step = saved["step"]
        print(f"resumed from {last} at step {step}")
    elif args.init_from:
        origin = torch.load(args.init_from, map_location="cpu", weights_only=False)
        for name in ("layers", "r", "heads"):
            if origin["args"][name] != getattr(args, name):
                raise SystemExit(
                    f"--init-from {args.init_from} was trained with --{name} {origin['args'][name]}, "
                    f"not {getattr(args, name)}: pass the same --{name}"
                )
        set_peft_model_state_dict(model, origin["adapter"])
        print(f"starting from the adapter of {args.init_from} (its step {origin['step']})")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    curriculum = parse_curriculum(args.curriculum)
    layouts = layout_cycle(args.layout)  # the saved run's, taken in turn by update

    def schedule(s: int) -> float:  # linear warm-up, then cosine to zero at --steps
        warm = min(1.0, (s + 1) / max(1, args.warmup))
        return warm * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, args.steps))))

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16)
    n_params = sum(p.numel() for p in trainable)
    print(f"memory layers {args.layers} ({n_params / 1e6:.2f} M trainable); steps {step}->{args.steps}")

    def eval_sets(at: int) -> list[tuple[int, int]]:
        if not args.eval_facts:
            return [stage_at(curriculum, at)[1]]
        sets = []
        for part in args.eval_facts.split(","):
            lo, _, hi = part.partition("-")
            sets.append((int(lo), int(hi or lo)))
        return sets

    def held_out(facts: tuple[int, int]) -> list[dict]:
        """The ``--eval-episodes`` held-out episodes every score reads (seed ``1000 + --seed``)."""
        knobs = episode_knobs(
            args, facts, held_out=True, history_tokens=args.eval_history_tokens, tokenizer=tokenizer
        )
        return english_episodes(args.eval_episodes, "heldout", seed=1000 + args.seed, **knobs)

    def eval_layouts() -> list[str]:
        if args.eval_layouts:
            return args.eval_layouts.split(",")
        return list(dict.fromkeys(layouts))

    @torch.no_grad()
    def recall(facts: tuple[int, int], layout: str, max_new_tokens: int = 8) -> dict:
        """Greedy answers from memory (read-only) to held-out questions; a hit when the normalised
        answer starts with the normalised gold at a word boundary (``recall_hit``, as
        ``examples/english_recall.py`` counts). Also from an empty memory, for the same check."""
        held = held_out(facts)
        model.eval()
        hits = {"memory": 0, "empty": 0}
        by_relation: dict[str, list[int]] = {}  # relation -> [memory hits, episodes]
        samples = []
        for start in range(0, len(held), 8):
            chunk = held[start : start + 8]
            laid = [choice_rows(tokenizer, e, layout) for e in chunk]
            prompts = [rows[0][0][: len(rows[0][0]) - rows[0][1]] for _, rows in laid]  # the prompt alone
            ids, mask = left_pad(prompts, pad)
            for condition in hits:
                cache = MemoryCache()
                if condition == "memory":
                    h, hm = left_pad([h for h, _ in laid], pad)
                    write_history(model, h, cache, attention_mask=hm, progress=False)
                out = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    memory_cache=cache,
                    memory_write=False,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=pad,
                )
                texts = tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
                for e, text in zip(chunk, texts, strict=True):
                    hit = recall_hit(text, e["gold"])
                    hits[condition] += hit
                    if condition == "memory":  # by relation, and every answer, for reading the misses
                        tally = by_relation.setdefault(e["relation"], [0, 0])
                        tally[0], tally[1] = tally[0] + hit, tally[1] + 1
                        samples.append(
                            {
                                "relation": e["relation"],
                                "question": e["question"],
                                "gold": e["gold"],
                                "answer": text.strip(),
                            }
                        )
        model.train()
        return {
            "facts": list(facts),
            "layout": layout,
            "n": len(held),
            **{c: v / len(held) for c, v in hits.items()},
            "memory_by_relation": {r: {"memory": h / n, "n": n} for r, (h, n) in sorted(by_relation.items())},
            "samples": samples,
        }

    @torch.no_grad()
    def other_history(facts: tuple[int, int], layout: str) -> dict:
        """Forced choice with another held-out episode's history in memory (one of the same relation
        where there is one): the control for what memory adds whatever the history says. Recall shows
        as ``memory`` (own history) above this, not only above an empty memory."""
        held = held_out(facts)
        swapped = swap_histories(held)
        model.eval()
        with autocast:
            res = forced_choice(
                model, tokenizer, swapped, conditions=("memory",), layout=layout, batch_size=8
            )
        model.train()
        return {"facts": list(facts), "layout": layout, "n": len(held), "memory_other_history": res["memory"]}

    def near_miss_choice(facts: tuple[int, int], layout: str, k: int = 3) -> dict:
        """Forced choice of the gold against ``k`` near misses of it (its digits in another order, one
        digit changed: ``near_misses``), from memory: whether the memory holds a number's digits in
        order, which the choice among the history's values (all far from the gold) does not test.
        Episodes whose value has no digits are left out; chance is ``1 / (k + 1)``."""
        held = held_out(facts)
        posed = []
        for i, e in enumerate(held):
            wrong = near_misses(e["gold"], k, random.Random(i))
            if len(wrong) == k:
                posed.append({**e, "choices": [e["gold"], *wrong]})
        memory = None  # no episode posed: relations whose values have no digits
        if posed:
            model.eval()
            with torch.no_grad(), autocast:
                res = forced_choice(
                    model, tokenizer, posed, conditions=("memory",), layout=layout, batch_size=8
                )
            model.train()
            memory = res["memory"]
        return {
            "facts": list(facts),
            "layout": layout,
            "n": len(posed),
            "memory": memory,
            "chance": 1 / (k + 1),
        }

    def evaluate(at: int) -> dict:
        """Held-out forced choice (memory, empty, chance) at each of ``--eval-facts`` (default: the stage's)."""
        model.eval()
        out: dict = {"eval": []}
        t = time.time()
        for facts, layout in itertools.product(eval_sets(at), eval_layouts()):
            held = held_out(facts)
            with torch.no_grad(), autocast:
                res = forced_choice(
                    model, tokenizer, held, conditions=("memory", "empty"), layout=layout, batch_size=8
                )
            out["eval"].append(
                {
                    "facts": list(facts),
                    "layout": layout,
                    "memory": res["memory"],
                    "empty": res["empty"],
                    "chance": round(res["chance"], 4),
                    "n": res["num_episodes"],
                }
            )
        model.train()
        out["eval_s"] = round(time.time() - t, 1)
        return out

    def checkpoint() -> None:
        tmp = last + ".tmp"
        torch.save(
            {
                "adapter": get_peft_model_state_dict(model),
                "optimizer": optimizer.state_dict(),
                "step": step,
                "args": vars(args),
                "memory_id": config.memory_id,
            },
            tmp,
        )
        os.replace(tmp, last)
        model.save_pretrained(os.path.join(args.output_dir, "adapter"))

    def export(folder: str) -> None:
        from lstmem_peft.training.card import record_training, write_model_card
        from lstmem_peft.tuner.backbones import BACKBONES

        if saved is None:
            raise SystemExit(f"--export: {last} does not exist; train first (the same --output-dir)")
        records = [json.loads(line) for line in open(log_path)] if os.path.exists(log_path) else []
        seconds = sum(r.get("step_s", 0) + r.get("eval_s", 0) for r in records)
        model.peft_config[model.active_adapter].base_model_name_or_path = args.model
        model.save_pretrained(folder)
        if args.export_dtype != "float32":
            from safetensors.torch import load_file, save_file

            weights = os.path.join(folder, "adapter_model.safetensors")
            stored = getattr(torch, args.export_dtype)
            tensors = {k: v.to(stored).contiguous() for k, v in load_file(weights).items()}
            save_file(tensors, weights, metadata={"format": "pt"})
        record_training(
            model,
            base_model_files=f"{args.model} (lstmem models; the GGUF's tensors dequantised to float32)",
            data=f"english_episodes, train split: {args.style} style, "
            + (
                f"{args.chatter} lines of chatter per fact"
                if float(parse_range(args.chatter)[1])
                else "no chatter"
            )
            + (f", filled with chatter to {args.history_tokens} tokens" if args.history_tokens else "")
            + ", same-relation facts"
            + (f", relations {args.relations}" if args.relations else ""),
            recipe=f"stage 1 (gradients through the writes), answer CE + {args.contrast_weight} x contrast "
            f"(the next episode's history), AdamW lr {args.lr}, {args.warmup} warm-up then cosine, batch "
            f"{args.batch}, curriculum {args.curriculum}"
            + (", one relation per update" if args.one_relation_per_step else "")
            + (f" (cycling through {args.step_relations})" if args.step_relations else "")
            + (
                f", episodes in the {layouts[0]} layout"
                if len(layouts) == 1
                else f", episodes in the {', '.join(layouts)} layouts in turn by update"
            ),
            started_from=args.init_from or "random initialisation (the library's)",
            updates=step,
            time=f"{seconds / 60:.0f} min of updates and evaluations on a CPU ({args.threads} thread(s))",
        )
        known = BACKBONES.get(args.model)
        original = known.original if known else None
        summary = (
            f"Trained with examples/train_english.py on `--model {args.model}`"
            + (
                f": {original} from {known.package}'s GGUF ({known.quantisation}), dequantised to float32 "
                "(close to, not equal to, the original weights)"
                if known
                else ""
            )
            + ". It writes English notes into memory and answers questions about them with the notes "
            "gone from the prompt."
        )
        write_model_card(model, folder, base_model=original or args.model, summary=summary)
        scores = os.path.join(args.output_dir, "eval.json")
        if os.path.exists(scores):
            shutil.copy(scores, os.path.join(folder, "eval.json"))
        print(f"wrote {folder} (step {step})")

    def log(record: dict) -> None:
        with open(log_path, "a") as fh:
            fh.write(json.dumps(record) + "\n")

    if args.export:
        export(args.export)
        return

    if args.eval_only:
        result = {"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **evaluate(step)}
        sets = list(itertools.product(eval_sets(step), eval_layouts()))
        result["recall"] = [] if args.no_recall else [recall(facts, layout) for facts, layout in sets]
        result["other_history"] = [other_history(facts, layout) for facts, layout in sets]
        result["near_miss_choice"] = [near_miss_choice(facts, layout) for facts, layout in sets]
        with open(os.path.join(args.output_dir, "eval.json"), "w") as fh:
            json.dump(result, fh, indent=1)
        print(json.dumps(result, indent=1))
        return

    model.train()
    if step == 0:
        log(
            {
                "step": 0,
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "settings": vars(args),
                **evaluate(0),
            }
        )
    start = time.time()
    run_losses: list[tuple[float, float, float]] = []
    bar = tqdm(total=args.steps, initial=step, desc="train", dynamic_ncols=True)
    while step < args.steps:
        stage, facts = stage_at(curriculum, step)
        rng_seed = args.seed * 1_000_003 + step
        asked = None
        if args.one_relation_per_step:
            pool = (args.step_relations or args.relations or ",".join(TRAIN_RELATIONS)).split(",")
            asked = [pool[step % len(pool)]]
        length = history_length(args.history_tokens, rng_seed)
        knobs = episode_knobs(args, facts, asked, history_tokens=length, tokenizer=tokenizer)
        episodes = english_episodes(args.batch, "train", seed=rng_seed, **knobs)
        layout = layouts[step % len(layouts)]
        laid = [choice_rows(tokenizer, e, layout) for e in episodes]
        gold = [list(e["choices"]).index(e["gold"]) for e in episodes]
        if args.choice_weight == 0:  # only the gold reads are needed
            laid = [(h, [rows[g]]) for (h, rows), g in zip(laid, gold, strict=True)]
            gold = [0] * len(laid)
        reads = [ids for _, rows in laid for ids, _ in rows]
        n_answer = [n for _, rows in laid for _, n in rows]
        owner = [i for i, (_, rows) in enumerate(laid) for _ in rows]
        if args.contrast_weight:  # each gold read again, from the next episode's memory
            for i, ((_, rows), g) in enumerate(zip(laid, gold, strict=True)):
                reads.append(rows[g][0])
                n_answer.append(rows[g][1])
                owner.append((i + 1) % len(laid))
        misses = []  # per episode, how many near-miss reads follow (from its own memory)
        if args.near_miss_weight:
            for i, e in enumerate(episodes):
                wrong = near_misses(e["gold"], args.near_misses, random.Random(rng_seed * 31 + i))
                misses.append(len(wrong))
                if wrong:
                    _, rows = choice_rows(tokenizer, {**e, "choices": [e["gold"], *wrong]}, layout)
                    reads += [ids for ids, _ in rows[1:]]
                    n_answer += [n for _, n in rows[1:]]
                    owner += [i] * len(wrong)
        owner = torch.tensor(owner)
        for group in optimizer.param_groups:
            group["lr"] = args.lr * schedule(step)
        t0 = time.time()
        with autocast:
            cache = MemoryCache()
            history_ids, history_mask = left_pad([h for h, _ in laid], pad)
            write_history(model, history_ids, cache, attention_mask=history_mask, progress=False)
            cache.batch_select_indices(owner)
            flat = read_scores(model, reads, n_answer, pad, cache).float()
        answer_sum, answer_tokens, choice_terms, correct = 0.0, 0, [], 0
        at = 0
        for (_, rows), g in zip(laid, gold, strict=True):
            s = flat[at : at + len(rows)]
            answer_sum = answer_sum - s[g]
            answer_tokens += rows[g][1]
            choice_terms.append(torch.logsumexp(s, 0) - s[g])
            correct += int(s.argmax().item() == g)
            at += len(rows)
        answer_loss = answer_sum / answer_tokens
        contrast_loss, near_miss_loss, near_miss_acc = torch.zeros(()), torch.zeros(()), 0.0
        own = torch.stack([flat[sum(len(r) for _, r in laid[:i]) + g] for i, g in enumerate(gold)])
        if args.contrast_weight:
            other = flat[at : at + len(laid)]
            contrast_loss = -torch.nn.functional.logsigmoid(own - other).mean()
            at += len(laid)
        if any(misses):  # the gold against its near misses, each read from the episode's own memory
            terms, won = [], 0
            for i, k in enumerate(misses):
                if k:
                    s = torch.cat([own[i : i + 1], flat[at : at + k]])
                    terms.append(torch.logsumexp(s, 0) - s[0])
                    won += int(s.argmax().item() == 0)
                    at += k
            near_miss_loss, near_miss_acc = torch.stack(terms).mean(), won / len(terms)
        choice_loss = torch.stack(choice_terms).mean()
        loss = (
            args.answer_weight * answer_loss
            + args.choice_weight * choice_loss
            + args.contrast_weight * contrast_loss
            + args.near_miss_weight * near_miss_loss
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, 1.0).item()
        optimizer.step()
        step += 1
        step_s = time.time() - t0
        run_losses.append((answer_loss.item(), choice_loss.item(), correct / len(laid)))
        record = {
            "step": step,
            "stage": stage,
            "facts": list(facts),
            "layout": layout,
            **({"relation": asked[0]} if asked else {}),
            "history_tokens": round(history_mask.sum(1).float().mean().item(), 1),  # the batch's mean
            "answer_loss": round(answer_loss.item(), 4),
            "choice_loss": round(choice_loss.item(), 4),
            "contrast_loss": round(contrast_loss.item(), 4),
            **(
                {"near_miss_loss": round(near_miss_loss.item(), 4), "near_miss_acc": round(near_miss_acc, 4)}
                if any(misses)
                else {}
            ),
            "train_choice_acc": correct / len(laid),
            "grad_norm": round(grad_norm, 4),
            "lr": optimizer.param_groups[0]["lr"],
            "step_s": round(step_s, 2),
        }
        recent = run_losses[-20:]
        bar.set_postfix(
            ans=f"{sum(a for a, _, _ in recent) / len(recent):.3f}",
            ch=f"{sum(c for _, c, _ in recent) / len(recent):.3f}",
            acc=f"{sum(x for _, _, x in recent) / len(recent):.2f}",
            s=f"{step_s:.1f}",
        )
        bar.update(1)
        if step % args.eval_every == 0 or step == args.steps:
            record.update(evaluate(step))
            record["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            for e in record["eval"]:
                tqdm.write(
                    f"step {step}: held-out forced choice ({e['facts']} facts, {e['layout']}, n={e['n']}): "
                    f"memory {e['memory']:.3f} "
                    f"empty {e['empty']:.3f} chance {e['chance']:.3f}"
                )
        log(record)
        out_of_time = args.max_minutes is not None and (time.time() - start) / 60 > args.max_minutes
        if step % args.save_every == 0 or step == args.steps or out_of_time:
            checkpoint()
        if out_of_time:
            tqdm.write(f"stopping at step {step}: --max-minutes {args.max_minutes} reached (rerun to resume)")
            break
    bar.close()


if __name__ == "__main__":
    random.seed(0)
    main()
