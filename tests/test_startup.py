"""A quiet, fast start (issue 38 item 7, issue 46 item 3): ``lstmem --version``, ``--help`` and every
subcommand's ``--help`` load neither torch, PEFT, transformers nor the library (the command's front,
``lstmem_cli``, answers them) and print nothing on stderr; ``import lstmem_peft`` registers LSTMem in
PEFT's tables with plain code (no import hook is left behind), in either order with ``import peft``,
loads no optional backend and prints nothing that ``import peft`` alone does not; the README's first
command installs what ``lstmem demo`` needs and nothing more, its second is what ``.ci/run`` runs.

Each start is a fresh interpreter (a subprocess) run at the repository's root, where the README's
commands run and where Python finds the root's folders first: ``import peft``, which imports
bitsandbytes when it is installed, which imports the Hub's ``kernels`` package, is as clean there as
anywhere (``kernels/`` is a plain folder around ``lstmem_kernels``, tests/test_layout.py). The checks
are on the modules a start loads, which do not depend on the machine's load; the one time bound is
generous. Timings: benchmarks/startup_time.py.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lstmem_cli.parser import SUBCOMMANDS
from lstmem_peft.utils.extras import EXTRAS
from lstmem_peft.utils.version import __version__

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"lstmem_peft", "lstmem_cli", "lstmem_kernels"}
#: What a start of the command line's help and version may not load.
HEAVY = {"torch", "peft", "transformers", "lstmem_peft"}

# Runs the code of argv[2] (its own arguments: argv[3:]) in a fresh interpreter, then writes as JSON
# to the file argv[1]: the top-level names of every module loaded, whether LSTMEM is in PEFT's tables
# (None: PEFT not loaded), the modules of the finders on sys.meta_path and the code's ``status`` if it
# set one.
PROBE = """
import json, sys
exec(sys.argv[2])
loaded = sorted({name.partition(".")[0] for name in sys.modules})
registered = None
if "peft" in sys.modules:
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING
    registered = "LSTMEM" in PEFT_TYPE_TO_CONFIG_MAPPING
finders = [type(finder).__module__ for finder in sys.meta_path]
with open(sys.argv[1], "w") as fh:
    json.dump({"modules": loaded, "registered": registered, "finders": finders,
               "status": globals().get("status")}, fh)
"""

# ``lstmem ARGV`` through the command's entry point, its exit status kept (code for PROBE).
CLI = """
from lstmem_cli import main
try:
    status = main(sys.argv[3:])
except SystemExit as exit_:
    status = exit_.code
"""

# ``python -m lstmem_cli ARGV``, its exit status kept (code for PROBE).
CLI_MODULE = """
import runpy
given = sys.argv
sys.argv = ["lstmem", *given[3:]]
try:
    runpy.run_module("lstmem_cli", run_name="__main__")
except SystemExit as exit_:
    status = exit_.code
finally:
    sys.argv = given
"""


def probe(
    tmp_path: Path, code: str, *argv: str, cwd: Path = ROOT, path: Path | None = None
) -> tuple[dict, subprocess.CompletedProcess]:
    """``code`` run in a fresh interpreter in ``cwd`` (the repository's root unless told), ``path``
    first on its ``PYTHONPATH``: (the modules it loaded, its output). The report goes to ``tmp_path``."""
    report = tmp_path / "report.json"
    report.unlink(missing_ok=True)
    env = {**os.environ, "COLUMNS": "1000"}  # argparse wraps no line
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(report), code, *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(report.read_text()), result


# ---------------------------------------------------------------------- the command line
HELP_AND_VERSION = [
    ["--version"],
    ["--help"],
    *([name, "--help"] for name in SUBCOMMANDS),
    ["data", "long", "--help"],
]


@pytest.mark.parametrize("code", [CLI, CLI_MODULE], ids=["lstmem_cli.main", "python -m lstmem_cli"])
@pytest.mark.parametrize("argv", HELP_AND_VERSION, ids=" ".join)
def test_version_and_help_load_neither_torch_peft_transformers_nor_the_library(argv, code, tmp_path):
    report, result = probe(tmp_path, code, *argv)
    assert report["status"] == 0
    heavy = HEAVY & set(report["modules"])
    assert not heavy, f"lstmem {' '.join(argv)} imported {sorted(heavy)}"
    assert result.stderr == "", result.stderr
    if argv == ["--version"]:
        assert result.stdout == f"lstmem-peft {importlib.metadata.version('lstmem-peft')}\n"
    else:
        command = " ".join(["lstmem", *argv[:-1]])
        assert result.stdout.startswith(f"usage: {command} "), result.stdout[:200]
    if argv == ["--help"]:
        for name, (summary, _) in SUBCOMMANDS.items():
            assert re.search(rf"^ +{name} +{re.escape(summary)}$", result.stdout, re.M), name
    elif argv[0] in SUBCOMMANDS and argv[0] != "data":
        assert SUBCOMMANDS[argv[0]][0] in result.stdout


def test_the_version_is_the_installed_distribution_s():
    """``--version`` reads the installed metadata (not the package, which would load the library); an
    install from this checkout has the version the package declares."""
    assert importlib.metadata.version("lstmem-peft") == __version__


def _console_script() -> str:
    """The installed ``lstmem`` script, or a skip when none is installed or it predates lstmem_cli."""
    script = shutil.which("lstmem", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("no lstmem console script next to this Python: pip install -e . installs it")
    (entry,) = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "lstmem"]
    if entry.value != "lstmem_cli:main":
        pytest.skip(f"the installed lstmem script runs {entry.value}: pip install -e . again")
    return script


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["serve", "--help"]], ids=" ".join)
def test_the_console_script_answers_quietly_within_seconds(argv):
    """The installed ``lstmem`` script, as a user runs it. The bound is generous (about 0.3 s on this
    2-core CPU when idle, 2026-11-27; over 10 s when torch and PEFT load)."""
    script = _console_script()
    start = time.perf_counter()
    result = subprocess.run([script, *argv], cwd=ROOT, capture_output=True, text=True, timeout=600)
    elapsed = time.perf_counter() - start
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.startswith("lstmem-peft " if argv == ["--version"] else "usage: lstmem")
    assert elapsed < 5.0, f"lstmem {' '.join(argv)} took {elapsed:.1f} s"


def test_the_command_s_front_imports_nothing_of_the_library_at_module_level():
    """lstmem_cli imports ``lstmem_peft`` only inside :func:`lstmem_cli.main`, after parsing."""
    import ast

    for path in sorted((ROOT / "lstmem_cli").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            heavy = {n.partition(".")[0] for n in names} & HEAVY
            assert not heavy, f"{path.name} imports {sorted(heavy)} at module level"


# ---------------------------------------------------------------------- import lstmem_peft
def test_the_public_names_are_the_defining_modules_own():
    import lstmem_peft
    from lstmem_peft.tuner.config import LSTMemConfig

    for name in lstmem_peft.__all__:
        assert getattr(lstmem_peft, name) is not None, name
    assert set(lstmem_peft.__all__) <= set(dir(lstmem_peft))
    assert lstmem_peft.LSTMemConfig is LSTMemConfig and lstmem_peft.tuner.config.LSTMemConfig is LSTMemConfig
    with pytest.raises(AttributeError, match="has no attribute 'LSTMemConfg'"):
        lstmem_peft.LSTMemConfg  # noqa: B018


def test_registering_writes_peft_s_three_tables():
    """The config table holds PeftLoaderConfig (PEFT's loaders read an adapter's config through it),
    the tuner table LSTMemModel, the prefix table its prefix; running it again changes nothing."""
    from peft import mapping

    import lstmem_peft
    from lstmem_peft.tuner.config import PeftLoaderConfig

    tables = (mapping.PEFT_TYPE_TO_CONFIG_MAPPING, mapping.PEFT_TYPE_TO_TUNER_MAPPING)
    expected = (PeftLoaderConfig, lstmem_peft.LSTMemModel, lstmem_peft.LSTMemModel.prefix)
    assert (*(table["LSTMEM"] for table in tables), mapping.PEFT_TYPE_TO_PREFIX_MAPPING["LSTMEM"]) == expected
    lstmem_peft.register_with_peft()
    assert mapping.PEFT_TYPE_TO_CONFIG_MAPPING["LSTMEM"] is PeftLoaderConfig


# Builds, saves and loads an LSTMem model through PEFT's own functions, after the imports of argv[3]
# (code for PROBE; tests/ on the path for tiny_models).
PEFT_DOORS = """
sys.path.insert(0, "tests")
exec(sys.argv[3])
import tempfile
from peft import PeftModel, get_peft_model
from lstmem_peft import LSTMemConfig
from tiny_models import tiny_model

model = get_peft_model(tiny_model(), LSTMemConfig(r=4, num_heads=2))
with tempfile.TemporaryDirectory() as folder:
    model.save_pretrained(folder)
    again = PeftModel.from_pretrained(tiny_model(), folder)
status = [type(model.base_model).__name__, type(again.base_model).__name__]
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "imports",
    ["import lstmem_peft\nimport peft", "import peft\nimport lstmem_peft"],
    ids=["package-first", "peft-first"],
)
def test_import_lstmem_peft_is_all_peft_s_doors_need_in_either_order(imports, tmp_path):
    report, _ = probe(tmp_path, PEFT_DOORS, imports)
    assert report["status"] == ["LSTMemModel", "LSTMemModel"] and report["registered"] is True
    assert not [f for f in report["finders"] if f.partition(".")[0] in FIRST_PARTY], report["finders"]


def _optional_backends() -> set[str]:
    """Module names of the installed distributions that an extra of pyproject.toml adds to the core."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def name(requirement: str) -> str:
        return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group()).lower()

    core = {name(r) for r in project["dependencies"]}
    optional = {name(r) for extra in project["optional-dependencies"].values() for r in extra}
    optional -= core | {name(project["name"])}  # `test` names the project's own extras
    owners = importlib.metadata.packages_distributions()
    return {module for module, dists in owners.items() if {name(d) for d in dists} & optional}


def _peft_output(stderr: str) -> list[str]:
    """stderr's lines without the time and process id that torch's logging puts in front."""
    return [re.sub(r"^[IWEF]\d{4} [\d:.]+ +\d+ ", "", line) for line in stderr.splitlines()]


@pytest.fixture(scope="module")
def peft_alone(tmp_path_factory):
    return probe(tmp_path_factory.mktemp("peft"), "import peft")


@pytest.mark.slow
@pytest.mark.parametrize(
    "code",
    [
        "import lstmem_peft",
        "import lstmem_peft\nimport peft",
        "import peft\nimport lstmem_peft",
        "from lstmem_peft import LSTMemConfig",
    ],
    ids=["package", "package-then-peft", "peft-then-package", "a-public-name"],
)
def test_registering_with_peft_adds_no_backend_and_no_output_to_peft_own(code, peft_alone, tmp_path):
    """PEFT's own import loads what it finds installed (bitsandbytes, torchao, triton with the test
    extra) and prints their load failures; registering LSTMem on top may add neither."""
    (alone, alone_result), (report, result) = peft_alone, probe(tmp_path, code)
    assert report["registered"] is True and alone["registered"] is False
    assert not [f for f in report["finders"] if f.partition(".")[0] in FIRST_PARTY], report["finders"]
    added = set(report["modules"]) - set(alone["modules"])
    backends = (added & _optional_backends()) | (added & {m.replace("-", "_") for m in EXTRAS})
    assert not backends, f"{code!r} loaded optional backends that import peft does not: {sorted(backends)}"
    assert result.stdout == alone_result.stdout == ""
    assert _peft_output(result.stderr) == _peft_output(alone_result.stderr), result.stderr


# ---------------------------------------------------------------------- import peft at the root
#: A stand-in for the Hub's ``kernels`` package, whose ``get_kernel`` bitsandbytes calls when PEFT
#: imports it (bitsandbytes 0.50's CPU backend, on a CPU with AVX512-BF16): it loads nothing.
HUB_KERNELS = """
class _Kernel:
    gemm_4bit_forward = None  # bitsandbytes falls back to its own CPU code


def get_kernel(repo_id, *args, **kwargs):
    return _Kernel()
"""

#: bitsandbytes's warning when no ``kernels`` package is installed reads ``No module named 'kernels'``
#: elsewhere; at the root, ``kernels/`` is a namespace package (a plain folder is one when nothing
#: installed has the name), which holds no ``get_kernel``.
NAMESPACE_KERNELS = "cannot import name 'get_kernel' from 'kernels' (unknown location)"

# ``import peft``, and which ``kernels`` module it imported if any (code for PROBE).
PEFT_AND_KERNELS = """
import peft
status = getattr(sys.modules.get("kernels"), "__file__", None)
"""


@pytest.fixture
def hub_kernels(tmp_path) -> Path:
    """A folder holding the stand-in ``kernels`` package, for PYTHONPATH."""
    (tmp_path / "site" / "kernels").mkdir(parents=True)
    (tmp_path / "site" / "kernels" / "__init__.py").write_text(HUB_KERNELS)
    return tmp_path / "site"


def test_at_the_root_an_installed_kernels_package_outranks_the_kernels_folder(hub_kernels, tmp_path):
    report, _ = probe(
        tmp_path,
        "import kernels\nstatus = [kernels.__file__, hasattr(kernels, 'get_kernel')]",
        path=hub_kernels,
    )
    assert report["status"] == [str(hub_kernels / "kernels" / "__init__.py"), True]
    report, _ = probe(tmp_path, "import lstmem_kernels\nstatus = lstmem_kernels.__file__")
    assert Path(report["status"]).parts[-2:] == ("lstmem_kernels", "__init__.py"), report["status"]


@pytest.mark.slow
def test_import_peft_at_the_root_with_bitsandbytes_is_clean(peft_alone, hub_kernels, tmp_path):
    """With bitsandbytes installed, PEFT's import at the root imports the installed ``kernels``
    package (here a stand-in) and prints nothing about it; with none installed, it prints what it
    prints anywhere else (bitsandbytes's own request to install one, on a CPU it would use it on), and
    names no file of the checkout."""
    pytest.importorskip("bitsandbytes")
    report, result = probe(tmp_path, PEFT_AND_KERNELS, path=hub_kernels)
    assert "bitsandbytes" in report["modules"]
    assert report["status"] in (None, str(hub_kernels / "kernels" / "__init__.py"))  # None: not asked for
    assert result.stdout == "" and not re.search(r"\bkernels\b", result.stderr), result.stderr
    (_, alone_result), (_, outside) = peft_alone, probe(tmp_path, "import peft", cwd=tmp_path)
    assert alone_result.stdout == "" and str(ROOT) not in alone_result.stderr, alone_result.stderr
    at_root = _peft_output(alone_result.stderr.replace(NAMESPACE_KERNELS, "No module named 'kernels'"))
    assert at_root == _peft_output(outside.stderr), alone_result.stderr


# ---------------------------------------------------------------------- the README's two commands
def _two_commands() -> list[str]:
    """The commands of the README's "Two commands" block, their comments dropped."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"^## Two commands\n+```bash\n(.*?)^```", readme, re.S | re.M)
    assert block, 'README.md has no "## Two commands" section opening with a bash block'
    return [line.split(" #")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_the_first_command_installs_the_core_and_the_second_is_what_ci_runs():
    first, second = _two_commands()
    assert re.fullmatch(r"pip install (-c \.ci/constraints\.txt )?-e \. && lstmem demo", first), first
    assert '-e ".[test]"' in second and second.endswith("&& python -m pytest -q"), second
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert any(line == second or line.startswith(f"{second} ||") for line in ci), (
        f".ci/run does not run the README's test command: {second}"
    )


@pytest.mark.slow
def test_lstmem_demo_needs_no_extra(tmp_path):
    """The README's first command installs the core alone: the demo runs with every extra's package
    failing to import, as if not installed."""
    blocked = sorted(m.replace("-", "_") for m in EXTRAS)
    code = f"""
import importlib.abc, sys

class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

sys.meta_path.insert(0, NotInstalled())
from lstmem_cli import main
status = main(["demo", "--episodes", "32", "--no-ablations"])
"""
    report, result = probe(tmp_path, code)
    assert report["status"] == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout.splitlines()[-1])
    assert 0 <= summary["recall_memory"] <= 1 and summary["num_episodes"] == 32
    assert not set(report["modules"]) & set(blocked)
