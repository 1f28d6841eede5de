"""``lstmem eval ... --rows``: the named rows of :mod:`lstmem_peft.eval.rows` in one resumable run
(no-context, window, memory-only, paper, bm25), and the checks of their options."""

from __future__ import annotations

import os
import sys

from lstmem_peft.utils.errors import UsageError


def check_rows(args) -> None:
    """``--rows`` and its options: known rows, the options that go with them, a benchmark with turns."""
    if args.rows is None:
        if args.window is not None or args.top_k is not None or args.bootstrap != 1000:
            raise UsageError(
                "--window, --top-k and --bootstrap go with --rows; expected --rows too. Add --rows ROWS"
            )
        return
    from lstmem_peft.eval.rows import TURN_ROWS, parse_rows

    try:
        args.rows = parse_rows(args.rows)
    except ValueError as err:
        raise UsageError(f"--rows: {err}") from None
    if args.memory_only or args.no_base or args.rescore is not None:
        raise UsageError(
            "--rows names every row of the run itself (memory-only, no-context, ...); expected no --memory-only, "
            "--no-base or --rescore with it. Drop them"
        )
    needs_turns = [r for r in args.rows if r in TURN_ROWS]
    if needs_turns and args.benchmark != "locomo":
        raise UsageError(
            f"rows {', '.join(needs_turns)} cut histories at turns, which only locomo has; expected locomo, or "
            f"rows no-context and memory-only with {args.benchmark}"
        )


def eval_rows(args, model, tokenizer, benchmark, out, decoding, template_kwargs) -> int:
    """``lstmem eval ... --rows``: the named rows of :mod:`lstmem_peft.eval.rows` in one resumable run."""
    from lstmem_peft.eval import row_report, rows
    from lstmem_peft.eval.protocol import data_identity

    summary = rows.evaluate_rows(
        model,
        tokenizer,
        benchmark,
        out,
        args.rows,
        window=args.window,
        top_k=args.top_k or rows.DEFAULT_TOP_K,
        decoding=decoding,
        block_size=args.block_size,
        chat_template=False if args.no_chat_template else None,
        template_kwargs=template_kwargs,
        run_info={
            "model": args.model,
            "adapter": args.adapter,
            "data": args.data,
            **data_identity(benchmark, args.data),
        },
        resume=args.resume,
        bootstrap=args.bootstrap,
        command=" ".join(["lstmem", *sys.argv[1:]]) if os.path.basename(sys.argv[0]) == "lstmem" else None,
    )
    print(row_report.render(summary))
    print(f"wrote {out}/predictions.jsonl, {out}/summary.json, {out}/results.md")
    return 0
