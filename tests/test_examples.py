"""The examples run as a user would run them."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_runs_offline(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py"), "--max-new-tokens", "4"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "reloaded adapter + memory give identical logits: True" in result.stdout
    assert result.stdout.count("Q: ") == 2
