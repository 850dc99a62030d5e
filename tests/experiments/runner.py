"""Run an experiment script the way a user does (a subprocess from the repo root) and read its result."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_script(args: list[str], results_dir: Path | None = None, **env: str) -> str:
    """`python <args>` from the repo root, W&B off, results under `results_dir`; returns stdout.

    Fails the test with the script's output when it exits non-zero."""
    return run_script_streams(args, results_dir, **env)[0]


def run_script_streams(args: list[str], results_dir: Path | None = None, **env: str) -> tuple[str, str]:
    """run_script's run; returns (stdout, stderr): progress goes to stderr."""
    full_env = {**os.environ, "WANDB_MODE": "disabled", **env}
    if results_dir is not None:
        full_env["MEGASLIDE_RESULTS_DIR"] = str(results_dir)
    done = subprocess.run([sys.executable, *args], cwd=REPO_ROOT, env=full_env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, done.stderr


def load_result(results_dir: Path, experiment: str, name: str) -> dict:
    return json.loads((results_dir / experiment / f"{name}.json").read_text())


def load_trial_result(out_dir: Path, experiment: str, name: str) -> dict:
    """The result a trial run (ExperimentRun(trial=True), out_dir `out_dir`) writes under its run folder."""
    return load_result(out_dir / experiment / name / "results", experiment, name)
