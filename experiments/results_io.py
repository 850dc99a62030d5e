"""Provenance-stamped result files: every figure under results/ goes through here.

A result is one JSON file `results/<experiment>/<name>.json` holding the payload plus the
command that produced it, the code that ran, the hardware and the date. Tables are
generated from these files by `experiments/report.py`, never typed by hand.

The code that ran is recorded as
- `commit`: the full 40-hex sha of HEAD;
- `dirty`: whether the tree differed from that commit (None: not known);
- `diff_sha256`, when dirty: the sha256 of `git diff HEAD --binary` (tracked changes, staged
  or not) followed by one line `untracked <path> <sha256 of its content>` per untracked,
  not-ignored file, so new files count too. results/ (data the runs write, not code that
  runs) and the stamp file below are left out of the diff, the dirty flag and the stamp;
- `provenance_source`: where these came from, in this order of trust:
  1. `git`: the tree is a git work tree (a developer's machine, CI); git is asked directly.
  2. `stamp`: a copy of the tree without .git (a GPU machine). Right before sending it, run
         python -m experiments.results_io stamp
     which writes `.provenance.json` at the repo root: commit, dirty, diff_sha256 and the
     sha256 of every file of the tree. On the GPU machine every result checks those files
     against the stamp; any file changed or missing since stamping (a stale stamp) gives
     `dirty: true`, no diff hash and `stamp_mismatch` naming the files.
     The stamp must travel with the copy, which holds tracked and untracked-not-ignored
     files, so it is NOT git-ignored; and it must never be committed, or it would describe
     an old tree to every clone. A copy that carries a .git of an older commit (the device
     machines here do) records that commit plus a diff unless it runs with
     `MEGASLIDE_PROVENANCE=stamp`, which makes the stamp the only source.
     Otherwise it is read only where there is no .git (where git
     can answer it is ignored, so one left behind is harmless), `stamp` refuses to write
     it while it is tracked, tests/experiments/test_results_io.py fails if it is tracked,
     and a stamp that does not match the files it lists is never trusted.
  3. `environment`: no .git and no stamp: `MEGASLIDE_GIT_COMMIT`, `MEGASLIDE_GIT_DIRTY`
     (1/0) and `MEGASLIDE_GIT_DIFF_HASH` from the launch command, unverified.
  4. `unknown`.
The code state is taken once per process, when this module is imported (every script imports
it at start), so a commit or an edit made while a long run goes on does not relabel it.

    python -m experiments.results_io stamp     # before sending the tree to a GPU machine
    python -m experiments.results_io audit     # one provenance status per result (--strict: exit 1 unless all ok)

The audit gives every results/**/*.json exactly one status (AUDIT_STATUSES, first that applies):
unverifiable (git, the recorded commit or the file is not available here: said, not guessed),
not-an-ancestor (`git merge-base --is-ancestor COMMIT HEAD` says no), dirty (the recorded flag, or
an old `+dirty` commit suffix), unknown (no dirty flag, or one that no check stands behind: only the
`git` and `stamp` sources verify it), ok. A `provenance_note` is shown beside the status, never
instead of it: it is a person's account, not a check.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "results"
STAMP_FILE = ".provenance.json"
NOT_CODE = ["results", STAMP_FILE]   # left out of the diff, the dirty flag and the stamp
DIRTY_NOTE = " (dirty tree)"
UNKNOWN_NOTE = " (provenance unknown)"
MARKS_NOTE = (f"A result marked{DIRTY_NOTE} ran on a tree that differed from its commit; one marked{UNKNOWN_NOTE} "
              "recorded no verified dirty flag (`python -m experiments.results_io audit` lists each result's status).")


# ----------------------------------------------------------------------------- the code that ran
def _git(root: Path, *args: str) -> bytes:
    return subprocess.run(["git", "-c", "core.quotepath=off", *args], cwd=root, capture_output=True,
                          check=True).stdout


def _exclude() -> list[str]:
    return ["--", ".", *(f":(exclude){p}" for p in NOT_CODE)]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree_files(root: Path) -> list[str]:
    """Tracked and untracked-not-ignored files present in the tree, results/ and the stamp left out."""
    names = _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard", *_exclude()).split(b"\0")
    return sorted({n.decode() for n in names if n and (root / n.decode()).is_file()})


def is_ancestor(ancestor: str, commit: str = "HEAD", root: Path = REPO_ROOT) -> bool | None:
    """Whether `ancestor` is in the history of `commit` (`git merge-base --is-ancestor`); None where git
    cannot tell: no git, not a repository, a commit unknown here (a shallow clone) or ambiguous."""
    try:
        code = subprocess.run(["git", "merge-base", "--is-ancestor", ancestor, commit], cwd=root,
                              capture_output=True, check=False).returncode
    except OSError:
        return None
    return {0: True, 1: False}.get(code)


def descends_from(commit: str, ancestor: str, root: Path = REPO_ROOT) -> bool:
    """Whether the code of `commit` includes `ancestor` (False where git cannot tell)."""
    return is_ancestor(ancestor, commit, root) is True


def git_state(root: Path = REPO_ROOT) -> dict:
    """`commit`, `dirty` and (when dirty) `diff_sha256` of the git work tree at `root`."""
    commit = _git(root, "rev-parse", "HEAD").decode().strip()
    diff = _git(root, "diff", "HEAD", "--binary", "--no-color", "--no-ext-diff", "--no-textconv", "--no-renames",
                *_exclude())
    untracked = _git(root, "ls-files", "-z", "--others", "--exclude-standard", *_exclude()).split(b"\0")
    listing = "".join(f"untracked {n} {_sha256(root / n)}\n" for n in sorted(u.decode() for u in untracked if u))
    state = {"commit": commit, "dirty": bool(diff or listing)}
    if state["dirty"]:
        state["diff_sha256"] = hashlib.sha256(diff + listing.encode()).hexdigest()
    return state


def stamp(root: Path = REPO_ROOT) -> Path:
    """Write `root/.provenance.json`: `git_state` plus the sha256 of every file of the tree."""
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", STAMP_FILE], cwd=root, capture_output=True,
                             check=False)
    if tracked.returncode == 0:
        raise RuntimeError(f"{STAMP_FILE} is tracked; it must never be committed: git rm --cached {STAMP_FILE}")
    record = {**git_state(root), "stamped": _now(), "files": {n: _sha256(root / n) for n in tree_files(root)}}
    path = root / STAMP_FILE
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def _from_stamp(root: Path) -> dict:
    record = json.loads((root / STAMP_FILE).read_text())
    changed = sorted(n for n, digest in record["files"].items()
                     if not (root / n).is_file() or _sha256(root / n) != digest)
    state = {k: record[k] for k in ("commit", "dirty", "diff_sha256") if k in record}
    if changed:
        state = {"commit": record["commit"], "dirty": True, "stamp_mismatch": changed}
    return {**state, "provenance_source": "stamp"}


def _from_environment() -> dict:
    dirty = os.environ.get("MEGASLIDE_GIT_DIRTY", "").lower()
    state = {"commit": os.environ["MEGASLIDE_GIT_COMMIT"],
             "dirty": True if dirty in ("1", "true") else False if dirty in ("0", "false") else None}
    if os.environ.get("MEGASLIDE_GIT_DIFF_HASH"):
        state["diff_sha256"] = os.environ["MEGASLIDE_GIT_DIFF_HASH"]
    return {**state, "provenance_source": "environment"}


def code_state(root: Path = REPO_ROOT) -> dict:
    """The code in the tree at `root`: git, else a verified stamp, else the environment (module docstring).
    `MEGASLIDE_PROVENANCE=stamp` trusts only the stamp: for a copy that carries a stale .git."""
    if os.environ.get("MEGASLIDE_PROVENANCE") == "stamp":
        if not (root / STAMP_FILE).is_file():
            raise RuntimeError(f"MEGASLIDE_PROVENANCE=stamp but there is no {STAMP_FILE}: run "
                               f"`python -m experiments.results_io stamp` before sending the tree")
        return _from_stamp(root)
    if (root / ".git").exists():
        try:
            return {**git_state(root), "provenance_source": "git"}
        except (OSError, subprocess.CalledProcessError):
            pass
    if (root / STAMP_FILE).is_file():
        return _from_stamp(root)
    if os.environ.get("MEGASLIDE_GIT_COMMIT"):
        return _from_environment()
    return {"commit": "unknown", "dirty": None, "provenance_source": "unknown"}


_CODE_AT_START = code_state(REPO_ROOT)


def is_dirty(result: dict) -> bool:
    """Whether a result ran on a tree that differed from its commit (old files: a `+dirty` commit suffix)."""
    return result.get("dirty") is True or str(result.get("commit", "")).endswith("+dirty")


def provenance_mark(result: dict) -> str:
    """The mark generated pages put beside the name of a result file whose record does not show a clean tree:
    DIRTY_NOTE for a dirty one, UNKNOWN_NOTE where no verified dirty flag was recorded (`record_status`)."""
    return {"dirty": DIRTY_NOTE, "unknown": UNKNOWN_NOTE}.get(record_status(result)[0], "")


# ----------------------------------------------------------------------------- result files
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


REFERENCE_GPU = "H200"   # the GPU the claims page and the planner's measured steps speak of; others' results
                         # keep their own pages


ANY_GPU = ""   # ran_on(result, ANY_GPU): ran on GPUs of any kind


def ran_on(result: dict, gpu: str) -> bool:
    """Whether `result` ran on GPUs, every one of them named with `gpu` (e.g. "H200"; ANY_GPU: any), by its
    recorded `hardware`: a page about one GPU keeps results of another (an H100 in an H200's place) out."""
    gpus = (result.get("hardware") or {}).get("gpus") or []
    return bool(gpus) and all(gpu in name for name in gpus)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def provenance() -> dict:
    return {"command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
            **_CODE_AT_START, "hardware": hardware(), "date": _now()}


def check_result_name(name: str, key: str = "name") -> str:
    """`name`, refused (ValueError naming the config `key` and the fix) unless it is one plain file name:
    a result name becomes `<results_dir>/<experiment>/<name>.json` and a run folder, so a separator or
    '..' would write outside them."""
    if not isinstance(name, str) or name.strip(" .") == "" or any(c in name for c in "/\\\0") or ".." in name:
        raise ValueError(f"{key}={name!r}: a result name must be one plain file name, not empty and without "
                         f"'/', '\\' or '..', as it becomes results/<experiment>/<name>.json: e.g. {key}=my_run "
                         f"(to write elsewhere, set MEGASLIDE_RESULTS_DIR)")
    return name


def check_writable_folder(path: Path | str, key: str, *, of_file: bool = False) -> Path:
    """`path` (absolute) as a folder this process can make or write into, else a ValueError naming the config `key`
    and the fix, raised before anything is written: the path, or its nearest existing ancestor, is a writable
    folder (a file there would end the run in a traceback at its first write, maybe after hours). `of_file`:
    `path` is a file to write, and its folder is checked."""
    folder = Path(path).absolute().parent if of_file else Path(path).absolute()
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        where = "is a file" if existing == folder and not of_file else f"lies under {existing}, a file"
        fix = "give a path in a folder" if of_file else "give a folder path"
        raise ValueError(f"{key}={str(path)!r} {where}, not a folder; {fix}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{key}={str(path)!r}: this user cannot write into {existing}; give a writable folder")
    return folder


def results_root(trial_dir: Path | str | None = None) -> Path:
    """The folder results go to: `$MEGASLIDE_RESULTS_DIR` when set (`MEGASLIDE_RESULTS_DIR=results` publishes a
    trial run); else, for a trial run (smoke, tiny, plan_only: `trial_dir`, the run's folder under runs/), that
    folder, so that trying a script never rewrites the tracked results/; else the repo's results/."""
    return Path(os.environ.get("MEGASLIDE_RESULTS_DIR") or trial_dir or RESULTS_DIR)


def result_path(experiment: str, name: str, results_dir: Path | str | None = None) -> Path:
    """`<results_dir>/<experiment>/<name>.json`; `results_dir` defaults to `results_root()`.
    `name` must pass `check_result_name`."""
    return Path(results_dir or results_root()) / experiment / f"{check_result_name(name)}.json"


def write_result(experiment: str, name: str, payload: dict, results_dir: Path | str | None = None) -> Path:
    """Write `payload` plus provenance to `result_path(experiment, name, results_dir)` atomically."""
    path = result_path(experiment, name, results_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {**provenance(), **payload}
    tmp = path.with_suffix(".json.tmp")
    try:
        tmp.write_text(json.dumps(record, indent=2, default=float) + "\n")
        os.replace(tmp, path)
    except BaseException:   # a full disk or an interrupt: no half-written temp file is left (the old result stays)
        tmp.unlink(missing_ok=True)
        raise
    return path


def is_partial(result: dict) -> bool:
    """Whether a result was cut short: fewer runs finished (`jobs_done`) than planned (`jobs_total`)."""
    return result.get("jobs_done", 0) < result.get("jobs_total", 0)


# ----------------------------------------------------------------------------- audit
AUDIT_STATUSES = {   # in the order the audit tries them; the first that applies is a result's status
    "unverifiable": "git, the recorded commit or the file is not available here, so nothing is assumed",
    "not-an-ancestor": "the recorded commit is not in the history of HEAD (rebased away or never merged)",
    "dirty": "the tree that ran differed from its commit by an uncommitted diff",
    "unknown": "no dirty flag was recorded, or one no check stands behind",
    "ok": "a clean tree (asked of git, or a verified stamp) at a commit in the history of HEAD",
}
VERIFIED_SOURCES = ("git", "stamp")   # the provenance sources whose dirty flag was checked when the result was written


def recorded_commit(result: dict) -> str:
    """The commit a result records, without an old '+dirty' suffix; "" where none is recorded."""
    commit = str(result.get("commit") or "").removesuffix("+dirty")
    return "" if commit == "unknown" else commit


def audit_status(result: dict, ancestor: Callable[[str], bool | None]) -> tuple[str, str]:
    """(status, why) of one result's record (module docstring); `ancestor(commit)` says whether the commit is in
    HEAD's history (None: git cannot tell), as `is_ancestor` does."""
    commit = recorded_commit(result)
    if not commit:
        return "unverifiable", "no commit recorded"
    answer = ancestor(commit)
    if answer is None:
        why = "git is not available here" if shutil.which("git") is None else \
            f"git cannot tell: commit {commit} is not in this repository (a shallow clone?) or is ambiguous"
        return "unverifiable", why
    if not answer:
        return "not-an-ancestor", f"{commit[:9]} is not in the history of HEAD"
    return record_status(result)


def record_status(result: dict) -> tuple[str, str]:
    """(status, why) that a result's record alone gives, without git: "dirty", "unknown" or "ok"
    (AUDIT_STATUSES; the audit first checks the commit against the repository's history)."""
    source = result.get("provenance_source")
    if is_dirty(result):
        mismatch = result.get("stamp_mismatch")
        return "dirty", (f"stale stamp: {', '.join(mismatch)} changed" if mismatch else
                         f"dirty flag ({source})" if result.get("dirty") is True else "'+dirty' commit suffix")
    if "dirty" not in result or result["dirty"] is None:
        return "unknown", "no dirty flag recorded"
    if source not in VERIFIED_SOURCES:
        return "unknown", f"dirty={result['dirty']} from the {source or 'unnamed'} source, not verified"
    return "ok", f"clean ({source})"


def audit_result(path: Path, root: Path = REPO_ROOT) -> dict:
    """`file`, `status` (one of AUDIT_STATUSES), `why`, `commit`, `source` and `note` (whether a
    provenance_note explains the run) of the result file at `path`."""
    row = {"file": path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path),
           "commit": None, "source": None, "note": False}
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        return {**row, "status": "unverifiable", "why": f"not readable as JSON: {err}"}
    if not isinstance(result, dict):
        return {**row, "status": "unverifiable", "why": "not a JSON object"}
    status, why = audit_status(result, lambda commit: is_ancestor(commit, "HEAD", root))
    return {**row, "commit": result.get("commit"), "source": result.get("provenance_source"),
            "note": bool(result.get("provenance_note")), "status": status, "why": why}


def audit(root: Path = REPO_ROOT, results_dir: Path | None = None) -> list[dict]:
    """`audit_result` of every results/**/*.json, sorted by path."""
    return [audit_result(p, root) for p in sorted((results_dir or root / "results").glob("**/*.json"))]


def audit_table(rows: list[dict]) -> str:
    """The audit as text: one line per result, then the count of each status."""
    width = max((len(r["file"]) for r in rows), default=4)
    lines = [f"{'status':<15} {'file':<{width}} {'commit':<9} {'source':<6} why"]
    for r in rows:
        why = r["why"] + ("; a provenance_note explains the run" if r["note"] else "")
        lines.append(f"{r['status']:<15} {r['file']:<{width}} {str(r['commit'] or '-')[:9]:<9} "
                     f"{r['source'] or '-':<6} {why}")
    counts = {s: sum(r["status"] == s for r in rows) for s in AUDIT_STATUSES}
    lines.append(f"{len(rows)} results: " + ", ".join(f"{s} {n}" for s, n in counts.items()))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="action", required=True)
    sub.add_parser("stamp", help=f"write {STAMP_FILE} before sending the tree to a machine without .git")
    check = sub.add_parser("audit", help="one provenance status per result: " + ", ".join(AUDIT_STATUSES))
    check.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    check.add_argument("--strict", action="store_true", help="exit with status 1 unless every result is ok")
    args = ap.parse_args()
    if args.action == "stamp":
        path = stamp()
        state = json.loads(path.read_text())
        print(f"wrote {path}: {state['commit']}{DIRTY_NOTE if state['dirty'] else ''}, {len(state['files'])} files")
        return
    rows = audit(REPO_ROOT, args.results_dir)
    print(audit_table(rows))
    if args.strict and any(r["status"] != "ok" for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
