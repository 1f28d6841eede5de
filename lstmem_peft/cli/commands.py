"""The ``lstmem`` command's subcommands: what the user gave is checked, then the subcommand runs
(:data:`RUNNERS`). The command line is parsed, and the command's filters set, before this module is
imported (:func:`lstmem_cli.main`; the arguments: :mod:`lstmem_cli.parser`).

lstmem demo                 # offline recall demo on the embedded backbone and adapters
lstmem demo --train         # retrain the adapters from scratch first (reports the time)
lstmem demo --model NAME    # a real backbone's shipped adapter (or --adapter) answering English notes from memory
lstmem demo --model ID --train   # the toy task's adapters trained on a Hub model or local path, then scored
lstmem demo --show 3        # first print 3 episodes: history, question, gold, the answers
lstmem demo --sweep         # recall against history length (8 to 256 facts): table, JSON record, plot
lstmem bench decode|generate|ops|e2e|write|scan [--preset cpu-small|qwen3-4b]   # JSON records
lstmem bench gpu [--dry-run]      # on a GPU: the paper's decode sweep (HF, vLLM) and the kernels' speed
lstmem bench gpu --acceptance [--dry-run]   # on a GPU: what works, in one short run (docs/gpu.md)
lstmem bench report benchmarks/results                                   # RESULTS.md + plots
lstmem eval locomo|hotpotqa|mab DATA --model ID --adapter PATH --out DIR [--protocol official|paper]
lstmem eval locomo|hotpotqa|mab DATA --rescore RUN/predictions.jsonl --protocol paper --out DIR
lstmem eval locomo DATA --model ID --adapter PATH --rows all --window 8192   # no-context ... bm25 rows, costs
lstmem serve [--model ID --adapter PATH] [--store DIR] [--port N]   # OpenAI-compatible server with memory
lstmem data long --out DIR --base-url URL --model NAME --tokenizer ID   # the stage-2 Long dataset
lstmem models [list|prepare NAME|remove NAME]   # real backbones by short name: --model smollm2-135m anywhere
"""

from __future__ import annotations

import os
import sys

from lstmem_peft.utils.errors import DataFormatError, MissingDataError, UsageError, looks_local

from .eval_rows import check_rows, eval_rows
from .models import run_models

# Exceptions that mean a bug in lstmem (or a library), not in what the user gave: their traceback is kept.
BUGS = (TypeError, AttributeError, NameError, KeyError, IndexError, AssertionError, UnboundLocalError)


def run(args) -> int:
    """The subcommand of the parsed command line ``args`` (:func:`lstmem_cli.parser.build_parser`).

    Exit status 2 with one line on stderr for what the user gave wrong -- a file or folder that is
    missing or not in the expected format, a bad option or option combination -- naming the file or
    option, what was expected and the fix (checked before any model loads); 1 with one line for other
    failures (a download, a model that will not load, out of memory); a bug in lstmem keeps its
    traceback. ``--debug`` shows the traceback in every case.
    """
    try:
        return RUNNERS[args.command](args)
    except KeyboardInterrupt:
        raise
    except UsageError as err:  # a bad file, format or option: one line that says what to do
        if args.debug:
            raise
        print(f"lstmem {_where(args)}: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except BUGS:
        raise
    except Exception as err:  # one line for the user; the traceback is one flag away
        if args.debug:
            raise
        if isinstance(err, OSError) and _given(args, err.filename):  # open() on a path the user gave
            line = f"{err.filename}: {err.strerror}; expected a path lstmem can use. Check the path and its permissions"
            print(f"lstmem {_where(args)}: error: {line}", file=sys.stderr)
            return 2
        print(
            f"lstmem {args.command}: error: {_one_line(err)} ({type(err).__name__}; --debug shows the traceback)",
            file=sys.stderr,
        )
        return 1


def _one_line(err: BaseException) -> str:
    text = str(err).strip()
    return " ".join(text.splitlines()[0].split()) if text else type(err).__name__


def _where(args) -> str:
    """The subcommand as typed: ``eval locomo``, ``bench report``, ``demo``, ``serve``."""
    if args.command == "eval":
        return f"eval {args.benchmark}"
    if args.command in ("bench", "data"):
        return f"{args.command} {args.kind}"
    if args.command == "models":
        return f"models {args.action}"
    return args.command


def _given(args, filename) -> bool:
    """Whether ``filename`` is one of the paths the user passed."""
    if not filename:
        return False
    options = ("data", "model", "adapter", "rescore", "entity_map", "out", "results", "folder", "store")
    given = [getattr(args, name, None) for name in (*options, "api_keys_file")]
    target = os.path.abspath(os.path.expanduser(os.fspath(filename)))
    return any(isinstance(v, str) and os.path.abspath(os.path.expanduser(v)) == target for v in given)


# ---------------------------------------------------------------------- checks before anything loads
MODEL_EXPECTED = "a model folder with config.json (as save_pretrained writes it) or a Hub model id owner/name"
ADAPTER_EXPECTED = (
    "an LSTMem adapter folder with adapter_config.json (as save_pretrained writes it) or a Hub id owner/name"
)


def _local(value: str) -> bool:
    """A ``--model``/``--adapter`` value meant as a local path (a Hub model id is ``name`` or ``owner/name``)."""
    return looks_local(value, bare_names=False) or value.count("/") > 1


def _check_folder(option: str, value: str | None, needs: str, expected: str, fix: str) -> None:
    """A local ``--model``/``--adapter`` must be a folder holding ``needs``; Hub ids are left to the Hub."""
    if value is None or not _local(value):
        return
    path = os.path.expanduser(value)
    label = f"{option} {value}"
    if not os.path.exists(path):
        raise MissingDataError(label, expected, "no such file or folder", fix)
    if not os.path.isdir(path):
        raise DataFormatError(label, expected, "a file, not a folder", fix)
    if not os.path.isfile(os.path.join(path, needs)):
        raise DataFormatError(label, expected, f"a folder without {needs}", fix)


def _check_model(value: str | None) -> None:
    """A short name of ``lstmem models`` must be usable (converted, or its package installed); a local
    folder must hold config.json."""
    from lstmem_peft.tuner.backbones import check_model

    check_model(value)  # cheap: no model loads, nothing converts yet
    fix = (
        "Pass the folder save_pretrained wrote for the backbone, its Hub id, or a short name of lstmem models"
    )
    _check_folder("--model", value, "config.json", MODEL_EXPECTED, fix)


def _resolve_model(value: str | None) -> str | None:
    """A ``--model`` value as the loaders take it: a short name becomes its converted folder (converted
    once, with a progress bar); a folder or Hub id stays as it is."""
    from lstmem_peft.tuner.backbones import resolve_model

    return resolve_model(value)


def _check_adapter(value: str | None, model: str | None) -> None:
    """A shipped adapter's short name must go with the backbone it was trained for (``--model``); a local
    folder must hold adapter_config.json."""
    from lstmem_peft.tuner.shipped_adapters import check_pair

    check_pair(model, value)
    fix = (
        "Pass the folder an LSTMem model's save_pretrained wrote (or LSTMemTrainer's output), its Hub id, or "
        "the short name of a shipped adapter (lstmem models lists them)"
    )
    _check_folder("--adapter", value, "adapter_config.json", ADAPTER_EXPECTED, fix)


def _check_output_folder(option: str, value: str | None, what: str = "the outputs") -> None:
    """An output folder may be missing (it is created) but not a file."""
    if value is not None and os.path.isfile(os.path.expanduser(value)):
        expected = f"a folder for {what} (created when missing)"
        raise DataFormatError(f"{option} {value}", expected, "an existing file", "Pass a folder path")


def _check_device(value: str | None) -> None:
    """``--device``: a device torch knows, and CUDA only where torch sees a GPU."""
    if value is None:
        return
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise UsageError(
            f"--device {value}: not a device torch knows; expected cpu, cuda or cuda:N. Pass --device cpu, "
            "or leave --device out (cuda when available)"
        ) from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UsageError(
                f"--device {value}: torch sees no CUDA device on this machine; expected cpu here. Pass "
                "--device cpu, or leave --device out"
            )
        if device.index is not None and device.index >= count:
            raise UsageError(
                f"--device {value}: torch sees {count} CUDA device(s); expected cuda:0 to cuda:{count - 1}. "
                "Pass one of those"
            )


def _key_values(pairs: list[str], option: str) -> dict:
    """``KEY=VALUE`` options as a dict (``VALUE`` read as JSON when it parses)."""
    import json

    kwargs = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(
                f"{option} {pair}: expected KEY=VALUE (VALUE read as JSON when it parses), e.g. "
                f"{option} enable_thinking=false"
            )
        try:
            kwargs[key] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[key] = value
    return kwargs


# ---------------------------------------------------------------------- subcommands
def _demo(args) -> int:
    _check_model(args.model)
    if args.model is not None and not args.train:  # a backbone's own adapter on English notes
        from .demo.english import demo_settings, run_english

        settings = demo_settings(args.model, args.adapter, args.episodes, args.show, args.out, args.sweep)
        _check_adapter(settings.adapter_name, args.model)
        _check_output_folder("--out", args.out, "the run's record")
        run_english(settings)
        return 0
    if args.adapter is not None:
        fix = "--train trains the toy task's adapters instead. Drop one" if args.train else "Pass --model too"
        raise UsageError(f"--adapter {args.adapter}: applies to --model (without --train) only. {fix}")
    if args.sweep is not None:
        _check_output_folder("--out", args.out, "the sweep's record and plot")
    from .demo.command import DemoSettings, run
    from .demo.sweep import SWEEP_FACTS

    run(
        train=args.train,
        model_id=_resolve_model(args.model),
        num_episodes=DemoSettings.num_episodes if args.episodes is None else args.episodes,
        ablations=not args.no_ablations,
        train_steps=args.steps,
        chat_steps=args.chat_steps,
        show=args.show or 0,
        show_facts=args.facts,
        sweep_facts=None if args.sweep is None else (tuple(args.sweep) or SWEEP_FACTS),
        window=args.window,
        out="." if args.out is None else args.out,
    )
    return 0


def _bench(args) -> int:
    from .bench import command as benchmarks

    if args.kind == "report":
        folder = args.folder or "benchmarks/results"
        results = os.path.expanduser(args.results)
        if os.path.isdir(results):
            raise DataFormatError(
                f"--results {args.results}", "the markdown file to write", "a folder", "Pass a file path"
            )
        parent = os.path.dirname(os.path.abspath(results))
        if not os.path.isdir(parent):
            raise MissingDataError(
                f"--results {args.results}",
                "a markdown file in an existing folder",
                f"no folder {parent}",
                "Create the folder first, or pass another path",
            )
        from .bench.records import report

        print(f"wrote {report(folder, results)}")  # reads (and checks) every record first
        return 0
    if args.folder is not None:
        raise UsageError(
            f"FOLDER {args.folder}: applies to lstmem bench report only; expected no FOLDER with "
            f"{args.kind}. Pass --out {args.folder} to choose where the records go"
        )
    for option, given in (
        ("--dry-run", args.dry_run),
        ("--steps", args.steps),
        ("--acceptance", args.acceptance),
        ("--budget-s", args.budget_s),
    ):
        if given and args.kind != "gpu":
            raise UsageError(
                f"{option} applies to lstmem bench gpu only; expected none with {args.kind}. Drop it"
            )
    if args.model is not None and args.kind not in ("decode", "generate", "ops", "e2e", "write"):
        raise UsageError(
            f"--model applies to lstmem bench decode, generate, ops, e2e and write; expected none with "
            f"{args.kind}. Drop it"
        )
    if args.model is not None and args.preset is not None:
        raise UsageError(
            "--model and --preset both choose the model; expected one of them. Drop --preset to time --model"
        )
    _check_model(args.model)
    if args.kind != "scan" and args.preset is not None and args.preset not in benchmarks.PRESETS:
        raise UsageError(
            f"--preset {args.preset}: unknown; expected one of {', '.join(sorted(benchmarks.PRESETS))}. "
            "Pass one of those"
        )
    if args.kind == "gpu":
        return _bench_gpu(args)
    args.preset = args.preset or "cpu-small"
    args.dtype = args.dtype or "float32"
    args.out = args.out or "benchmarks/results"
    _check_device(args.device)
    _check_output_folder("--out", args.out, "the JSON records")
    benchmarks.run(
        args.kind,
        preset=args.preset,
        device=args.device,
        dtype=args.dtype,
        out=args.out,
        reps=args.reps,
        model=args.model,
        kv_lengths=args.kv_lengths,
        histories=args.histories,
        answer_tokens=args.answer_tokens,
        prompt_tokens=args.prompt_tokens,
        tokens=args.tokens,
        lengths=args.lengths,
        batches=args.batches,
    )
    return 0


def _bench_gpu(args) -> int:
    """``lstmem bench gpu``: refuses (one line, status 2) without a GPU unless ``--dry-run``."""
    if args.acceptance:  # the acceptance run (cli/gpu/acceptance.py, docs/gpu.md)
        from .gpu.acceptance import run_from_args

        return run_from_args(args)
    from .bench.gpu_suite import require_gpu, run_suite

    require_gpu(args.device, args.dry_run)  # before anything loads
    _check_output_folder("--out", args.out, "the JSON records")
    _, clean = run_suite(
        out=args.out,
        dry_run=args.dry_run,
        device=args.device,
        steps=args.steps or ("hf", "vllm", "kernels"),
        preset=args.preset,
        dtype=args.dtype,
        kv_lengths=args.kv_lengths,
        reps=args.reps,
        new_tokens=args.answer_tokens,
        scan_lengths=args.lengths,
        scan_batches=args.batches,
    )
    return 0 if clean else 1


def _api_keys(path: str) -> list[str]:
    """The keys of ``--api-keys-file``: one a line, blank lines and ``#`` comments skipped."""
    label = f"--api-keys-file {path}"
    expected = "a text file with one accepted API key a line (# starts a comment)"
    fix = "Put one key a line in it, or pass the keys with --api-key KEY"
    full = os.path.expanduser(path)
    if not os.path.exists(full):
        raise MissingDataError(label, expected, "no such file", fix)
    if os.path.isdir(full):
        raise DataFormatError(label, expected, "a folder", fix)
    try:
        with open(full, encoding="utf-8") as fh:
            keys = [line.strip() for line in fh if line.strip() and not line.lstrip().startswith("#")]
    except UnicodeDecodeError:
        raise DataFormatError(label, expected, "not UTF-8 text", fix) from None
    except PermissionError:
        raise DataFormatError(
            label, "a file you can read", "permission denied", "Fix its permissions"
        ) from None
    if not keys:
        raise DataFormatError(label, expected, "no key in it", fix)
    return keys


def _serve(args) -> int:
    from lstmem_peft.tuner.shipped_adapters import default_adapter

    if args.adapter is None and (shipped := default_adapter(args.model)) is not None:
        args.adapter = shipped
        print(
            f"lstmem serve: --adapter {shipped} (shipped for {args.model}; --adapter to choose another)",
            file=sys.stderr,
        )
    if (args.model is None) != (args.adapter is None):
        raise UsageError(
            "--model and --adapter go together: expected both (a backbone and the LSTMem adapter trained on "
            "it) or neither (the embedded demo); a backbone with a shipped adapter (lstmem models) needs no "
            "--adapter. Pass the other one too"
        )
    if args.engine == "vllm" and args.model is None:
        raise UsageError(
            "--engine vllm: expected --model and --adapter (a Qwen3 or Llama backbone and its LSTMem "
            "adapter). Pass both, or drop --engine vllm to serve the embedded demo"
        )
    _check_model(args.model)
    _check_adapter(args.adapter, args.model)
    _check_device(args.device)
    _check_output_folder("--store", args.store, "the sessions' memory")
    keys = list(args.api_key)
    if args.api_keys_file is not None:
        keys += _api_keys(args.api_keys_file)
    vllm_options = _key_values(args.vllm_arg, "--vllm-arg")
    if vllm_options and args.engine != "vllm":
        raise UsageError(
            "--vllm-arg: applies to --engine vllm only; expected no --vllm-arg. Add --engine vllm"
        )
    from lstmem_peft.serve import serve

    serve(
        model=_resolve_model(args.model),
        adapter=args.adapter,
        store=args.store,
        host=args.host,
        port=args.port,
        name=args.name,
        device=args.device,
        dtype=args.dtype,
        api_keys=keys,
        threads=args.threads,
        context_window=args.context_window,
        max_batch=args.max_batch,
        batch_wait_ms=args.batch_wait_ms,
        batching=not args.no_batching,
        max_body_bytes=args.max_body_bytes,
        default_max_tokens=args.max_tokens,
        session_versions=args.session_versions,
        session_version_bytes=args.session_version_bytes,
        engine=args.engine,
        vllm_options=vllm_options,
    )
    return 0


def _eval_options(args) -> dict:
    """The benchmark's options; option combinations that do not apply raise :class:`UsageError`."""
    options = {"limit": args.limit, "max_new_tokens": args.max_new_tokens, "protocol": args.protocol}
    mab = args.benchmark == "mab"
    if args.split:
        if mab:
            raise UsageError(
                "--split does not apply to mab: its four splits are the families; expected no --split. "
                "Pass --families (AR TTL LRU SF) instead"
            )
        options["split"] = args.split
    if not mab and args.max_new_tokens is None:
        del options["max_new_tokens"]  # the benchmark's own (the paper's) limit
    if not mab and (args.max_questions is not None or args.entity_map is not None or args.families):
        raise UsageError(
            f"--max-questions, --entity-map and --families apply to mab only; expected none of them with "
            f"{args.benchmark}. Drop them"
        )
    if args.max_context_chars is not None and (not mab or args.protocol != "paper"):
        raise UsageError(
            "--max-context-chars applies to mab with --protocol paper only; expected it with both. Add "
            "--protocol paper, or drop --max-context-chars"
        )
    if args.max_context_chars is not None and args.max_context_chars < 0:
        raise UsageError(
            f"--max-context-chars: expected 0 (no clipping) or more, got {args.max_context_chars}. Pass 0 or "
            "a positive number of characters"
        )
    if args.passages != "all" and args.benchmark != "hotpotqa":
        raise UsageError(f"--passages applies to hotpotqa only; expected none with {args.benchmark}. Drop it")
    if args.benchmark == "hotpotqa":
        options["passages"] = args.passages
    if args.categories is not None:  # locomo only; 5 with the official protocol
        from lstmem_peft.eval.locomo import parse_categories

        if args.benchmark != "locomo":
            raise UsageError(
                f"--categories applies to locomo only; expected none with {args.benchmark}. Drop it"
            )
        try:
            options["categories"] = parse_categories(args.categories, args.protocol)
        except ValueError as err:
            raise UsageError(f"--categories: {err}") from None
    if mab:
        options.update(families=args.families, max_questions=args.max_questions, entity_map=args.entity_map)
        if args.max_context_chars is not None:
            options["max_context_chars"] = args.max_context_chars
    if args.rescore is None and args.model is None:
        raise UsageError(
            "--model is required; expected a base model (Hub id or local folder). Pass --model ID, or "
            "--rescore RUN/predictions.jsonl to re-score an existing run"
        )
    if args.rescore is not None and (args.model is not None or args.adapter is not None or args.resume):
        raise UsageError(
            "--rescore re-scores without a model; expected no --model, --adapter or --resume with it. Drop "
            "--model/--adapter/--resume"
        )
    check_rows(args)
    return options


def _eval(args) -> int:
    from lstmem_peft.eval import runner
    from lstmem_peft.eval.outputs import markdown_table
    from lstmem_peft.tuner import loading

    options = _eval_options(args)
    if args.benchmark == "locomo":
        from lstmem_peft.eval.locomo import DATA as spec
        from lstmem_peft.eval.locomo import LoCoMo as make
    elif args.benchmark == "hotpotqa":
        from lstmem_peft.eval.hotpotqa import DATA as spec
        from lstmem_peft.eval.hotpotqa import HotpotQA as make
    else:
        from lstmem_peft.eval.mab import DATA as spec
        from lstmem_peft.eval.mab import MemoryAgentBench as make
    # every user-given path and option before the data is read, and the data before the model loads
    if looks_local(args.data) and not os.path.exists(os.path.expanduser(args.data)):
        raise MissingDataError(f"DATA {args.data}", spec.expected, "no such file or folder", spec.fix)
    _check_model(args.model)
    _check_adapter(args.adapter, args.model)
    _check_device(args.device)
    out = args.out or f"eval-results/{args.benchmark}"
    _check_output_folder("--out", out)
    if args.entity_map is not None and not os.path.isfile(os.path.expanduser(args.entity_map)):
        got = "a folder" if os.path.isdir(os.path.expanduser(args.entity_map)) else "no such file"
        raise MissingDataError(
            f"--entity-map {args.entity_map}",
            "the snapshot's entity2id.json (entity URI -> id)",
            got,
            "Pass the entity2id.json of the ai-hyz/MemoryAgentBench snapshot",
        )
    template_kwargs = _key_values(args.template_arg, "--template-arg")
    benchmark = make(os.path.expanduser(args.data) if looks_local(args.data) else args.data, **options)
    if args.rescore is not None:
        summary = runner.rescore(os.path.expanduser(args.rescore), benchmark, out, plot=not args.no_plot)
        print(markdown_table(summary))
        print(f"wrote {out}/predictions.jsonl, {out}/summary.json, {out}/results.md")
        return 0
    model, tokenizer = loading.load_model_and_adapter(
        _resolve_model(args.model), args.adapter, dtype=args.dtype, device=args.device
    )
    if args.benchmark == "mab" and args.chunk_tokenizer == "model":  # histories are built when iterated
        benchmark.count_tokens = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])
    decoding = runner.Decoding(greedy=args.greedy)
    if args.seed is not None:
        decoding.seed = args.seed
    if args.rows is not None:
        return eval_rows(args, model, tokenizer, benchmark, out, decoding, template_kwargs)
    summary = runner.evaluate(
        model,
        tokenizer,
        benchmark,
        out,
        memory_only=args.memory_only,
        decoding=decoding,
        block_size=args.block_size,
        compare_base=not args.no_base,
        chat_template=False if args.no_chat_template else None,
        template_kwargs=template_kwargs,
        run_info={"model": args.model, "adapter": args.adapter, "data": args.data}
        | ({"chunk_tokenizer": args.chunk_tokenizer} if args.benchmark == "mab" else {}),
        resume=args.resume,
        plot=not args.no_plot,
    )
    print(markdown_table(summary))
    print(f"wrote {out}/predictions.jsonl, {out}/summary.json, {out}/results.md")
    return 0


def _data(args) -> int:
    from lstmem_peft.training import long_data

    return long_data.run(args)


#: What each subcommand of :data:`lstmem_cli.parser.SUBCOMMANDS` runs: ``args`` -> exit status.
RUNNERS = {
    "demo": _demo,
    "bench": _bench,
    "eval": _eval,
    "serve": _serve,
    "data": _data,
    "models": run_models,
}
