"""What every section of the claims page shares: reading a result JSON, linking it, a claim's row."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from experiments.report import result_files
from experiments.results_io import REFERENCE_GPU, provenance_mark, ran_on


def load(results_dir: Path, experiment: str, name: str) -> dict | None:
    """`<results_dir>/<experiment>/<name>.json` read, or None if it does not exist."""
    path = results_dir / experiment / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def link(results_dir: Path, experiment: str, name: str) -> str:
    """A result file's link, marked when its record shows a dirty tree or no verified clean one."""
    result = load(results_dir, experiment, name)
    marked = provenance_mark(result) if result is not None else ""
    return f"[{experiment}/{name}.json]({experiment}/{name}.json){marked}"


@dataclass
class Claim:
    """One row of the claims page: its id, the paper's figure, and how our figure and verdict are made."""

    id: str
    paper: str
    ours: Callable[[Path], tuple[str, str]]   # results folder -> (our figure with its source, verdict)


def tokens_text(n: int) -> str:
    """A token count as a table shows it: "64K" for a multiple of 1024, else the count with separators."""
    return f"{n // 1024}K" if n % 1024 == 0 else f"{n:,} tokens"


def read_results(results_dir: Path, experiment: str) -> list[tuple[str, dict]]:
    """(name, data) of every result JSON of `experiment` in the results folder, by name."""
    return [(f.stem, json.loads(f.read_text())) for f in result_files(experiment, results_dir)]


def widest(results_dir: Path, experiment: str, ranks_key: str, timed: str | None = None) -> tuple[str, dict] | None:
    """The GPU result of `experiment` with the most ranks, as (name, data); CPU smoke runs excluded.
    `timed`: only results with a finished timing of that variant (runs may time a subset)."""
    found = [(n, d) for n, d in read_results(results_dir, experiment) if ran_on(d, REFERENCE_GPU)
             and (timed is None or any(r["variant"] == timed and "time_s" in r for r in d.get("timings", [])))]
    return max(found, key=lambda nd: nd[1].get(ranks_key, 0), default=None)


def under_previous_rule(rule: str, verdict: str, until: str = "") -> str:
    """A verdict as the rule it replaced gave it, shown beside the new one: `rule` says what that rule was,
    `verdict` is what it gives on the same data and `until` the last commit that applied it, where recorded."""
    return f"under the previous rule ({f'up to commit {until}: ' if until else ''}{rule}): {verdict}"
