"""``lstmem models``: the real backbones lstmem knows by short name (installed? converted?), the adapters
shipped for each, and converting or removing one. Loads neither torch nor transformers to list them."""

from __future__ import annotations


def run_models(args) -> int:
    """``lstmem models``: list the known real backbones, convert one (printing its folder), or remove one."""
    from lstmem_peft.tuner import backbones
    from lstmem_peft.utils.shipped_adapters import SHIPPED_ADAPTERS

    if args.action == "prepare":
        print(backbones.resolve_backbone(args.name, force=args.force))  # progress and notes on stderr
    elif args.action == "remove":
        folder = backbones.remove_backbone(args.name)
        print(f"removed {folder}" if folder else f"{args.name}: not converted, nothing to remove")
    else:
        statuses = [backbones.backbone_status(name) for name in sorted(backbones.BACKBONES)]
        for status in statuses:  # the adapters shipped for it: --adapter NAME with --model NAME
            status["adapters"] = {
                a.name: a.summary for a in SHIPPED_ADAPTERS.values() if a.backbone == status["name"]
            }
        if args.json:
            import json

            print(json.dumps(statuses, indent=2))
        else:
            print(models_table(statuses, backbones.cache_home()))
    return 0


def models_table(statuses: list[dict], cache) -> str:
    """What ``lstmem models`` prints: each backbone, its state and what to run next."""
    lines = []
    for s in statuses:
        lines.append(f"{s['name']}: {s['original']} ({s['license']}); {s['architecture']}")
        size = f", {s['size_mb']} MB" if s["size_mb"] else ""
        lines.append(
            f"  source     pip package {s['package']} {s['version'] or ''}: {s['quantisation']}{size}"
        )
        if s["problem"]:
            lines.append(f"  installed  no: {s['problem']}")
        elif s["installed"]:
            lines.append(f"  installed  yes ({s['package']} {s['installed_version'] or ''}: {s['file']})")
        else:
            lines.append(f"  installed  no: {s['install'][0]}")
        if not s["gguf_installed"] and not s["converted"]:
            lines.append(f"  gguf       not installed (needed to convert): {s['install'][1]}")
        if s["converted"]:
            lines.append(f"  converted  {s['folder']} ({s['folder_mb']} MB): --model {s['name']} uses it")
        else:
            lines.append(
                f"  converted  no: lstmem models prepare {s['name']} (once; a first --model {s['name']} does it too)"
            )
        for adapter, summary in s.get("adapters", {}).items():
            lines.append(f"  adapter    --adapter {adapter} (shipped): {summary}")
    lines.append(f"converted backbones live in {cache} (set LSTMEM_HOME to move them)")
    return "\n".join(lines)
