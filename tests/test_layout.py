"""The package's wings import only downward (README "A short tour").

Read from the source (every ``import``, at module level or inside a function), not by importing it::

    front  >  cli  >  serve  >  eval, integrations  >  training  >  tuner  >  memory  >  utils, lstmem_kernels

``integrations`` (the vLLM plugin) skips the tuner: it builds its memory layers from ``memory``
(:class:`~lstmem_peft.memory.spec.MemorySpec`, read from the adapter's files), never from PEFT's
wrappers, so a vLLM worker does not load the PEFT tuner to run an adapter.

``front`` is the top-level ``lstmem_cli`` (the command's parser, version and filters, which run
before the library loads); it imports only ``cli`` (to run a subcommand) and nothing of the library
at module level (tests/test_startup.py). ``lstmem_peft/__init__.py`` (the public API) stands above
the library wings and below ``cli``; nothing inside the package imports it (importing any module
runs it first anyway, which registers LSTMem with PEFT). ``memory``, ``utils`` and the kernels
import neither transformers nor peft (``utils.offline`` builds tiny transformers models for tests
and demos and is the one exception).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The kernels' package: kernels/ itself is a plain folder (see test_nothing_at_the_root_shadows_a_package).
KERNELS = ROOT / "kernels" / "lstmem_kernels"

#: Each wing and the wings it may import (besides itself).
MAY_IMPORT = {
    "lstmem_kernels": set(),
    "utils": set(),
    "memory": {"utils", "lstmem_kernels"},
    "tuner": {"memory", "utils", "lstmem_kernels"},
    "training": {"tuner", "memory", "utils"},
    "eval": {"training", "tuner", "memory", "utils"},
    "integrations": {"memory", "utils", "lstmem_kernels"},
    "serve": {"integrations", "training", "tuner", "memory", "utils"},
    "api": {"training", "tuner", "memory", "utils"},
    "cli": {"api", "serve", "eval", "integrations", "training", "tuner", "memory", "utils", "lstmem_kernels"},
    "front": {"cli"},
}
#: Wings that stay free of the model libraries (the memory's math runs on plain tensors).
NO_MODEL_LIBRARIES = {"lstmem_kernels", "memory", "utils"}
MODEL_LIBRARY_EXCEPTIONS = {"lstmem_peft.utils.offline"}


def _modules() -> dict[str, Path]:
    """Every module of the package and of the kernels, each folder at any depth (``lstmem_kernels.scan``,
    ``lstmem_peft.cli.demo``, ...), by its dotted name."""
    found = {}
    for package, parent in (
        (ROOT / "lstmem_peft", ROOT),
        (ROOT / "lstmem_cli", ROOT),
        (KERNELS, KERNELS.parent),
    ):
        for path in sorted(package.rglob("*.py")):
            parts = list(path.relative_to(parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _wing(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "lstmem_kernels":
        return "lstmem_kernels"
    if parts[0] == "lstmem_cli":
        return "front"
    if len(parts) == 1:
        return "api"
    if parts[1] not in MAY_IMPORT:
        raise AssertionError(
            f"{module} stands in no wing: move it into one of {sorted(MAY_IMPORT)} (or add a wing to this test)"
        )
    return parts[1]


def _imports(module: str) -> set[str]:
    """Every module ``module`` imports (absolute dotted names; the nearest module of this project
    for a name imported from a package)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            submodules = {f"{target}.{alias.name}" for alias in node.names} & MODULES.keys()
            found.update(submodules)
            if len(submodules) < len(node.names):  # names defined in the module itself
                found.add(target)
    return found


GRAPH = {module: _imports(module) for module in MODULES}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_each_module_imports_only_downward(module):
    wing = _wing(module)
    upward = sorted(
        target
        for target in GRAPH[module]
        if target in MODULES and _wing(target) != wing and _wing(target) not in MAY_IMPORT[wing]
    )
    assert not upward, (
        f"{module} (wing {wing}) imports {upward}; it may import only {sorted(MAY_IMPORT[wing])}"
    )
    if wing in NO_MODEL_LIBRARIES and module not in MODEL_LIBRARY_EXCEPTIONS:
        libraries = sorted(t for t in GRAPH[module] if t.split(".")[0] in {"transformers", "peft", "vllm"})
        assert not libraries, (
            f"{module} (wing {wing}) imports {libraries}: keep the model libraries out of it"
        )


def _reached(start: set[str]) -> set[str]:
    """The project's modules that ``start`` imports, directly or through others (lazy imports
    included), and ``start`` itself."""
    seen, todo = set(start), list(start)
    while todo:
        for target in GRAPH[todo.pop()]:
            if target in MODULES and target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_the_vllm_plugin_builds_its_memory_without_the_tuner():
    """Issue 46 item 5: no module of the vLLM plugin imports ``lstmem_peft.tuner``, directly or through
    another module of the project, and none of the modules it reaches imports ``peft``: the plugin
    builds its memory layers from :mod:`lstmem_peft.memory.spec` (the adapter's
    :class:`~lstmem_peft.memory.spec.MemorySpec` and :func:`~lstmem_peft.memory.spec.memory_layer`, the
    factory the tuner builds with too). The package's ``__init__.py`` (the public API, which registers
    LSTMem with PEFT) is not counted: Python runs it before any submodule, see
    tests/test_vllm_args.py for what a process that skips it loads."""
    plugin = {m for m in MODULES if m.startswith("lstmem_peft.integrations.vllm")}
    assert plugin, "the plugin's modules moved: update this test"
    reached = _reached(plugin)
    tuner = sorted(m for m in reached if m.startswith("lstmem_peft.tuner"))
    assert not tuner, f"the vLLM plugin reaches the PEFT tuner: {tuner}"
    peft = sorted(m for m in reached if any(t.split(".")[0] == "peft" for t in GRAPH[m]))
    assert not peft, f"modules the vLLM plugin reaches import peft: {peft}"
    assert "lstmem_peft" not in reached, (
        "the plugin imports the package's public API (lstmem_peft/__init__.py)"
    )


def test_no_import_circles():
    """No two modules import each other, directly or through others (lazy imports included)."""
    edges = {m: {t for t in targets if t in MODULES and t != m} for m, targets in GRAPH.items()}
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node):  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    assert not circles, f"import circles: {circles}"


def test_every_module_stands_in_a_wing_the_wheel_ships():
    """Each package folder is listed in pyproject.toml (the wheel holds every module)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    assert packages <= listed, f"packages missing from pyproject.toml: {sorted(packages - listed)}"
    for module in MODULES:
        _wing(module)


def test_nothing_at_the_root_shadows_a_package():
    """Python puts the working folder first on its path, and the README's commands run at the root: a
    package or module there would hide any installed one of the same name (a ``kernels/__init__.py``
    hid the Hub's ``kernels`` package, which bitsandbytes imports when PEFT loads it). The root holds
    the packages it installs under their own names (the library and the command's front); ``kernels/``
    is a plain folder around ``lstmem_kernels``, which an installed ``kernels`` package outranks."""
    importable = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    importable |= {p.stem for p in ROOT.glob("*.py")}
    assert importable == {"lstmem_peft", "lstmem_cli"}, f"importable at the root: {sorted(importable)}"
    assert not list((ROOT / "kernels").glob("*.py")), "kernels/ holds only the lstmem_kernels package"
    assert (KERNELS / "__init__.py").exists()


def test_no_library_file_is_over_600_lines():
    """Files along real seams: a module past 600 lines holds more than one thing to read at once."""
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"split these along a seam: {long}"


def test_no_module_hands_on_names_it_does_not_use():
    """Moved names are moved, not re-exported: outside a package's ``__init__.py`` (the public
    faces), no ``from x import name as name`` and no module-level import kept only for others
    (``noqa: F401``; an import inside a function that only checks a package is installed is fine)."""
    offenders = []
    for path in MODULES.values():
        if path.name == "__init__.py":
            continue
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.parse(source).body:  # module level only
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            text = " ".join(lines[node.lineno - 1 : node.end_lineno])
            same = [a.name for a in node.names if a.asname == a.name]
            if "noqa: F401" in text or same:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text.strip()}")
    assert not offenders, "re-exports (import the name where it is defined instead):\n" + "\n".join(offenders)


#: Long functions whose reason is written here rather than beside them ("file:function": the reason, in
#: words), for files this test's owner does not edit; each entry must still name a long function.
LONG_FUNCTIONS: dict[str, str] = {}
#: A banner, not a reason: a run of rule characters (``# ---- the app``, ``# ====``).
BANNER = re.compile(r"([-=*#~_+])\1{2,}")
#: Words a reason needs at least (a sentence: "Long on purpose: one kernel is one launch").
REASON_WORDS = 5


def _reason_above(lines: list[str], first: int) -> str:
    """The comment block right above line ``first`` (1-based: the ``def`` or its first decorator), its
    lines without the ``#`` marks; empty if there is none."""
    block = []
    index = first - 2
    while index >= 0 and lines[index].strip().startswith("#"):
        block.insert(0, lines[index].strip().lstrip("#").strip())
        index -= 1
    return "\n".join(block)


def _says_why(reason: str) -> bool:
    """A reason in words: at least :data:`REASON_WORDS` words made of letters once the banners (lines
    with a rule in them) are left out."""
    sentences = " ".join(line for line in reason.split("\n") if not BANNER.search(line))
    return len([w for w in sentences.split() if any(c.isalpha() for c in w)]) >= REASON_WORDS


def _long_functions():
    """``("file:function", line, length, the comment above it)`` for each function of at least 80 lines."""
    for path in MODULES.values():
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if (
                isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and node.end_lineno - node.lineno >= 80
            ):
                first = min([d.lineno for d in node.decorator_list] + [node.lineno])
                where = f"{path.relative_to(ROOT)}:{node.name}"
                yield where, node.lineno, node.end_lineno - node.lineno + 1, _reason_above(lines, first)


def test_a_function_over_80_lines_says_why_beside_it():
    """No function over ~80 lines without a reason in words: a comment right above its ``def`` (or its
    decorators) that says why, in a sentence (a section banner such as ``# ---- the app`` is not one),
    or an entry in :data:`LONG_FUNCTIONS`."""
    silent = [
        f"{where.split(':')[0]}:{line} {where.split(':')[1]} ({length} lines)"
        + (f", above it only {reason!r}" if reason else "")
        for where, line, length, reason in _long_functions()
        if not _says_why(reason) and where not in LONG_FUNCTIONS
    ]
    assert not silent, "split these, or say beside them why they are long:\n" + "\n".join(silent)


def test_the_long_functions_listed_here_are_long_and_say_why():
    """Each entry of :data:`LONG_FUNCTIONS` names a function that is still long, with a reason in words."""
    long = {where for where, *_ in _long_functions()}
    stale = sorted(set(LONG_FUNCTIONS) - long)
    assert not stale, f"no longer long (or gone): drop them from LONG_FUNCTIONS: {stale}"
    assert all(_says_why(reason) for reason in LONG_FUNCTIONS.values())


#: What reads the call stack: frame objects and their fields, and code objects compared by identity.
FRAME_ATTRIBUTES = {
    "_getframe",
    "_current_frames",
    "f_code",
    "f_back",
    "f_locals",
    "f_globals",
    "__code__",
    "co_code",
}
#: ``inspect`` and ``traceback`` functions that walk the stack (``inspect.stack``, not ``torch.stack``).
STACK_FUNCTIONS = {
    "inspect": {"stack", "currentframe", "getouterframes", "getframeinfo", "trace", "getinnerframes"},
    "traceback": {"extract_stack", "walk_stack", "format_stack", "print_stack"},
    "sys": {"_getframe", "_current_frames"},
}


def test_no_library_code_reads_the_call_stack():
    """Issue 46 item 4: no behaviour depends on who called (``sys._getframe``, ``inspect.stack``, code
    objects compared); a refactor of PEFT's loaders would defeat that silently. A refusal is reached
    through a seam of the tuner's own loading path instead (``LSTMemConfig``'s entry in PEFT's table,
    the weights check PEFT calls)."""
    offenders = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            found = None
            if isinstance(node, ast.Attribute):
                owner = node.value.id if isinstance(node.value, ast.Name) else None
                if node.attr in FRAME_ATTRIBUTES or node.attr in STACK_FUNCTIONS.get(owner, ()):
                    found = f"{owner + '.' if owner else ''}{node.attr}"
            elif isinstance(node, ast.ImportFrom) and node.module in STACK_FUNCTIONS:
                names = [a.name for a in node.names if a.name in STACK_FUNCTIONS[node.module]]
                found = ", ".join(f"{node.module}.{name}" for name in names) or None
            if found:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {found}")
    assert not offenders, "reads the call stack:\n" + "\n".join(offenders)
