"""Provenance-stamped result files: every figure under results/ goes through here.

A result is one JSON file `results/<experiment>/<name>.json` holding the payload plus
the command that produced it, the git commit, the hardware and the date. Tables are
generated from these files by `experiments/report.py`, never typed by hand.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "results"


def git_commit() -> str:
    """The commit of the code that ran. On the GPU machine (no .git) the caller passes
    it in `MEGASLIDE_GIT_COMMIT`; a trailing `+dirty` marks uncommitted changes."""
    if os.environ.get("MEGASLIDE_GIT_COMMIT"):
        return os.environ["MEGASLIDE_GIT_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def hardware() -> dict:
    """What the run ran on: CPU, core count, GPUs and library versions."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    info = {"cpu": cpu, "cpu_cores": os.cpu_count(), "gpus": gpus, "torch": torch.__version__,
            "python": platform.python_version()}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def provenance() -> dict:
    return {
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "commit": git_commit(),
        "hardware": hardware(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def result_path(experiment: str, name: str, results_dir: Path | str | None = None) -> Path:
    """`<results_dir>/<experiment>/<name>.json`; `results_dir` defaults to `$MEGASLIDE_RESULTS_DIR`
    or the repo's results/ folder."""
    root = Path(results_dir or os.environ.get("MEGASLIDE_RESULTS_DIR") or RESULTS_DIR)
    return root / experiment / f"{name}.json"


def write_result(experiment: str, name: str, payload: dict, results_dir: Path | str | None = None) -> Path:
    """Write `payload` plus provenance to `result_path(experiment, name, results_dir)` atomically."""
    path = result_path(experiment, name, results_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {**provenance(), **payload}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2, default=float) + "\n")
    os.replace(tmp, path)
    return path


def is_partial(result: dict) -> bool:
    """Whether a result was cut short: fewer runs finished (`jobs_done`) than planned (`jobs_total`)."""
    return result.get("jobs_done", 0) < result.get("jobs_total", 0)
