"""The lint that CI runs: ruff with the project's config (pyproject.toml: line length 120, pycodestyle and
pyflakes rules) over the whole tree. ruff comes with the `dev` extra."""
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=REPO_ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
