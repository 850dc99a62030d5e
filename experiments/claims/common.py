"""What every section of the claims page shares: reading a result JSON, linking it, a claim's row."""
from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from experiments.report import result_files
from experiments.results_io import (ANY_GPU, REFERENCE_GPU, audit_status, is_ancestor, provenance_mark, ran_on,
                                   record_status, recorded_commit)


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


def newest_one_gpu(results_dir: Path, experiment: str, ranks_key: str) -> tuple[str, dict] | None:
    """The newest (by recorded date) result of `experiment` that ran on one GPU of any kind, as (name, data): a
    one-GPU figure may come from whichever card was lent, and `gpus_text` names it."""
    found = [(n, d) for n, d in read_results(results_dir, experiment) if ran_on(d, ANY_GPU) and d.get(ranks_key) == 1]
    return max(found, key=lambda nd: nd[1].get("date", ""), default=None)


def gpus_text(count: int, result: dict) -> str:
    """"1 H100", "2 H200s": a GPU count with the card model its result recorded ("GPU" when the names differ)."""
    names = (result.get("hardware") or {}).get("gpus") or []
    models = {m for name in names for m in re.findall(r"\b[A-Z]\d{3}\b", name)}
    return f"{count} {models.pop() if len(models) == 1 else 'GPU'}{'s' if count > 1 else ''}"


def under_previous_rule(rule: str, verdict: str, until: str = "") -> str:
    """A verdict as the rule it replaced gave it, shown beside the new one: `rule` says what that rule was,
    `verdict` is what it gives on the same data and `until` the last commit that applied it, where recorded."""
    return f"under the previous rule ({f'up to commit {until}: ' if until else ''}{rule}): {verdict}"


PROVENANCE_RULE = (
    "The rule of every verdict: it rests only on results whose provenance audit status is ok (a clean tree at a "
    "commit in the history of HEAD); each claim's own rule is applied to those alone. Where they leave a claim no "
    "evidence, its verdict is 'not assessed', naming the results to re-run from a clean commit; where leaving the "
    "others out changes a verdict, the parts it changes are shown beside it under the previous rule (results of any "
    "provenance counted). Our figures from every result stay shown in the 'ours' column.")
ANY_PROVENANCE = "results of any provenance counted; the parts of its verdict that differ"
PROVENANCE_WORDS = {"unknown": "unknown provenance", "dirty": "a dirty tree",
                    "not-an-ancestor": "a commit not in the history of HEAD"}
CITED = re.compile(r"\]\(([^()\s]+\.json)\)")   # the target of every result link (`link`) in a row


def provenance_status(result: dict, commits: dict[str, bool | None] | None = None) -> str:
    """"ok", "unknown", "dirty" or "not-an-ancestor": the audit's status of a result (results_io.AUDIT_STATUSES),
    save that where git cannot tell whether its commit is in HEAD's history (a shallow clone) its record decides,
    so the claims page is the same in every clone; no recorded commit is unknown. `commits`: is_ancestor answers
    by commit, filled as asked."""
    commits = {} if commits is None else commits

    def ancestor(commit: str) -> bool | None:
        if commit not in commits:
            commits[commit] = is_ancestor(commit)
        return commits[commit]
    status = audit_status(result, ancestor)[0]
    if status != "unverifiable":
        return status
    return record_status(result)[0] if recorded_commit(result) else "unknown"


@dataclass
class Evidence:
    """A results folder, its results' provenance statuses ("experiment/name.json" -> status) and, where some are
    not ok, a view of the folder holding only the ok ones: what PROVENANCE_RULE lets a verdict rest on."""
    results_dir: Path
    statuses: dict[str, str]
    ok_dir: Path | None

    def judge(self, claim: Claim) -> tuple[str, str]:
        """The claim's (our figure, verdict) under PROVENANCE_RULE: our figure from every result, links marked;
        the verdict by the claim's own rule on the ok results, unchanged where the others change nothing."""
        ours, verdict = claim.ours(self.results_dir)
        if self.ok_dir is None:
            return ours, verdict
        ok_ours, ok_verdict = claim.ours(self.ok_dir)
        if ok_verdict == verdict:
            return ours, verdict
        behind = self._described(CITED.findall(ours + verdict))
        if CITED.search(ok_ours + ok_verdict):   # the ok results give it evidence: their verdict stands
            shown = (f"{ok_verdict}; judged on results of known provenance only, leaving out those with {behind} "
                     f"(re-run them from a clean commit to count them)")
        else:
            shown = f"not assessed: its evidence has {behind}; re-run it from a clean commit"
        changed = "; ".join(c for c in clauses(verdict) if c not in shown) or verdict
        return ours, f"{shown}; {under_previous_rule(ANY_PROVENANCE, changed)}"

    def _described(self, cited: list[str]) -> str:
        """The cited results that are not ok, grouped by status: "unknown provenance (a.json, b.json)"."""
        groups: dict[str, list[str]] = {}
        for f in sorted(set(cited)):
            if self.statuses.get(f, "ok") != "ok":
                groups.setdefault(self.statuses[f], []).append(f)
        return " and ".join(f"{PROVENANCE_WORDS[s]} ({', '.join(fs)})" for s, fs in groups.items()) or \
            "no known clean provenance (results it reads without linking: `python -m experiments.results_io audit`)"


def clauses(text: str) -> list[str]:
    """The parts of a verdict separated by "; " outside brackets: "a (b; c); d" -> ["a (b; c)", "d"]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch in "([") - (ch in ")]")
        if depth == 0 and text.startswith("; ", i):
            parts.append(text[start:i])
            start = i + 2
    return parts + [text[start:]]


@contextmanager
def evidence(results_dir: Path) -> Iterator[Evidence]:
    """The Evidence of a results folder; its ok-only view (links to the ok result files) lasts while in use."""
    commits: dict[str, bool | None] = {}
    paths = {f"{f.parent.name}/{f.name}": f for f in sorted(results_dir.glob("*/*.json"))}
    statuses = {name: provenance_status(json.loads(f.read_text()), commits) for name, f in paths.items()}
    if all(s == "ok" for s in statuses.values()):
        yield Evidence(results_dir, statuses, None)
        return
    with tempfile.TemporaryDirectory(prefix="ok_results_") as view:
        for name, f in paths.items():
            if statuses[name] == "ok":
                (Path(view) / name).parent.mkdir(exist_ok=True)
                (Path(view) / name).symlink_to(f.resolve())
        yield Evidence(results_dir, statuses, Path(view))
