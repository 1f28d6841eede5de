"""A quiet, fast start (issue 38, item 7): ``lstmem --version`` and ``--help`` load neither torch nor
PEFT and print no warning; ``import lstmem_peft`` loads no optional backend and prints nothing, and
registering LSTMem with PEFT adds no backend and no output to what ``import peft`` itself brings; the
README's first command installs what ``lstmem demo`` needs and nothing more, its second is what
``.ci/run`` runs.

Each start is a fresh interpreter (a subprocess, run outside the repository, whose ``kernels/``
folder would shadow the Hub's ``kernels`` package). The checks are on the modules a start loads, which
do not depend on the machine's load; the one time bound is generous. Timings: benchmarks/startup_time.py.
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

from lstmem_peft.cli.parser import SUBCOMMANDS
from lstmem_peft.utils.extras import EXTRAS
from lstmem_peft.utils.version import __version__

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"lstmem_peft", "lstmem_kernels"}

# Runs the code of argv[2] (its own arguments: argv[3:]) in a fresh interpreter, then writes as JSON
# to the file argv[1]: the top-level names of every module loaded, whether LSTMEM is in PEFT's tables
# (None: PEFT not loaded) and the code's ``status`` if it set one.
PROBE = """
import json, sys
exec(sys.argv[2])
loaded = sorted({name.partition(".")[0] for name in sys.modules})
registered = None
if "peft" in sys.modules:
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING
    registered = "LSTMEM" in PEFT_TYPE_TO_CONFIG_MAPPING
with open(sys.argv[1], "w") as fh:
    json.dump({"modules": loaded, "registered": registered, "status": globals().get("status")}, fh)
"""

# ``lstmem ARGV`` through the package's entry point, its exit status kept (code for PROBE).
CLI = """
from lstmem_peft.cli import main
try:
    status = main(sys.argv[3:])
except SystemExit as exit_:
    status = exit_.code
"""


def probe(tmp_path: Path, code: str, *argv: str) -> tuple[dict, subprocess.CompletedProcess]:
    """``code`` run in a fresh interpreter in ``tmp_path``: (the modules it loaded, its output)."""
    report = tmp_path / "report.json"
    report.unlink(missing_ok=True)
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(report), code, *argv],
        cwd=tmp_path,
        env={**os.environ, "COLUMNS": "1000"},  # argparse wraps no line
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(report.read_text()), result


# ---------------------------------------------------------------------- the command line
@pytest.mark.parametrize(
    "argv",
    [["--version"], ["--help"], *([name, "--help"] for name in SUBCOMMANDS), ["data", "long", "--help"]],
    ids=" ".join,
)
def test_version_and_help_load_neither_torch_nor_peft_and_print_no_warning(argv, tmp_path):
    report, result = probe(tmp_path, CLI, *argv)
    assert report["status"] == 0
    heavy = {"torch", "peft", "transformers"} & set(report["modules"])
    assert not heavy, f"lstmem {' '.join(argv)} imported {sorted(heavy)}"
    assert result.stderr == "", result.stderr
    if argv == ["--version"]:
        assert result.stdout == f"lstmem-peft {__version__}\n"
    else:
        command = " ".join(["lstmem", *argv[:-1]])
        assert result.stdout.startswith(f"usage: {command} "), result.stdout[:200]
    if argv == ["--help"]:
        for name, (summary, _) in SUBCOMMANDS.items():
            assert re.search(rf"^ +{name} +{re.escape(summary)}$", result.stdout, re.M), name
    elif argv[0] in SUBCOMMANDS and argv[0] != "data":
        assert SUBCOMMANDS[argv[0]][0] in result.stdout


def test_the_console_script_answers_version_quietly_within_seconds(tmp_path):
    """The installed ``lstmem`` script, as a user runs it. The bound is generous (about 0.3 s on this
    2-core CPU when idle, 2026-11-27; over 10 s when torch and PEFT loaded)."""
    script = shutil.which("lstmem", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("no lstmem console script next to this Python: pip install -e . installs it")
    start = time.perf_counter()
    result = subprocess.run([script, "--version"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    elapsed = time.perf_counter() - start
    assert (result.returncode, result.stdout, result.stderr) == (0, f"lstmem-peft {__version__}\n", "")
    assert elapsed < 5.0, f"lstmem --version took {elapsed:.1f} s"


# ---------------------------------------------------------------------- import lstmem_peft
def test_import_loads_only_the_package_and_prints_nothing(tmp_path):
    bare, _ = probe(tmp_path, "pass")
    report, result = probe(tmp_path, "import lstmem_peft")
    added = set(report["modules"]) - set(bare["modules"]) - set(sys.stdlib_module_names)
    assert added == {"lstmem_peft"}, f"import lstmem_peft loaded {sorted(added - {'lstmem_peft'})}"
    assert (result.stdout, result.stderr) == ("", "")


def test_the_public_names_load_on_first_use():
    import lstmem_peft

    for name in lstmem_peft.__all__:
        assert getattr(lstmem_peft, name) is not None, name
    assert set(lstmem_peft.__all__) <= set(dir(lstmem_peft))
    from lstmem_peft.tuner.config import LSTMemConfig

    assert lstmem_peft.LSTMemConfig is LSTMemConfig and lstmem_peft.tuner.config.LSTMemConfig is LSTMemConfig
    with pytest.raises(AttributeError, match="has no attribute 'LSTMemConfg'"):
        lstmem_peft.LSTMemConfg  # noqa: B018


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
        "import lstmem_peft\nimport peft",
        "import peft\nimport lstmem_peft",
        "from lstmem_peft import LSTMemConfig",
    ],
    ids=["package-then-peft", "peft-then-package", "a-public-name"],
)
def test_registering_with_peft_adds_no_backend_and_no_output_to_peft_own(code, peft_alone, tmp_path):
    """PEFT's own import loads what it finds installed (bitsandbytes, torchao, triton with the test
    extra) and prints their load failures; registering LSTMem on top may add neither."""
    (alone, alone_result), (report, result) = peft_alone, probe(tmp_path, code)
    assert report["registered"] is True and alone["registered"] is False
    added = set(report["modules"]) - set(alone["modules"])
    backends = (added & _optional_backends()) | (added & {m.replace("-", "_") for m in EXTRAS})
    assert not backends, f"{code!r} loaded optional backends that import peft does not: {sorted(backends)}"
    assert result.stdout == alone_result.stdout == ""
    assert _peft_output(result.stderr) == _peft_output(alone_result.stderr), result.stderr


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
from lstmem_peft.cli import main
status = main(["demo", "--episodes", "32", "--no-ablations"])
"""
    report, result = probe(tmp_path, code)
    assert report["status"] == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout.splitlines()[-1])
    assert 0 <= summary["recall_memory"] <= 1 and summary["num_episodes"] == 32
    assert not set(report["modules"]) & set(blocked)
