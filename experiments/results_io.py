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
    python -m experiments.results_io audit     # which results record a commit that is not the code that ran

The audit asks, for every results/**/*.json, whether its recorded commit can be the code that
ran: the files of its script (the script in its `command` and the repository modules it
imports, read at the recorded commit) must not have changed in a commit dated before the
result (the tree sent then held that change), nor in the commit that added the result (the
run may have used that change uncommitted).
"""
from __future__ import annotations

import argparse
import ast
import datetime as _dt
import hashlib
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
STAMP_FILE = ".provenance.json"
NOT_CODE = ["results", STAMP_FILE]   # left out of the diff, the dirty flag and the stamp
DIRTY_NOTE = " (dirty tree)"


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


def descends_from(commit: str, ancestor: str, root: Path = REPO_ROOT) -> bool:
    """Whether the code of `commit` includes `ancestor` (False where git cannot tell: an unknown commit,
    a shallow clone, no git)."""
    try:
        return subprocess.run(["git", "merge-base", "--is-ancestor", ancestor, commit], cwd=root,
                              capture_output=True).returncode == 0
    except OSError:
        return False


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
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", STAMP_FILE], cwd=root, capture_output=True)
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


def dirty_note(result: dict) -> str:
    """The mark generated tables put beside the name of a result file from a dirty tree."""
    return DIRTY_NOTE if is_dirty(result) else ""


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


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def provenance() -> dict:
    return {"command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
            **_CODE_AT_START, "hardware": hardware(), "date": _now()}


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


# ----------------------------------------------------------------------------- audit
def script_of(command: str, files: set[str]) -> str | None:
    """The repository file of the script a result's `command` ran (`-m pkg.mod`, or a relative
    or absolute `.py` path, matched by its longest suffix present in `files`)."""
    args = shlex.split(command)
    if "-m" in args[:-1]:
        module = args[args.index("-m") + 1]
        return _module_file(module, files)
    for arg in args:
        if arg.endswith(".py"):
            parts = Path(arg).parts
            return next(("/".join(parts[i:]) for i in range(len(parts)) if "/".join(parts[i:]) in files), None)
    return None


def _module_file(module: str, files: set[str]) -> str | None:
    base = module.replace(".", "/")
    return next((f for f in (f"{base}.py", f"{base}/__init__.py") if f in files), None)


def _imported_modules(source: str, module: str, is_package: bool) -> set[str]:
    """Absolute names of the modules a source file imports (for `from m import n`: m and m.n)."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            stem = ".".join(base + (node.module.split(".") if node.module else []))
            found.add(stem)
            found.update(f"{stem}.{a.name}".lstrip(".") for a in node.names)
    return found


def script_files(root: Path, commit: str, script: str) -> list[str]:
    """The script and every repository module it imports, directly or not, with the
    `__init__.py` of each package on the way, as they were at `commit`."""
    files = set(_git(root, "ls-tree", "-r", "--name-only", commit).decode().splitlines())
    todo, seen = [script], set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        is_package = path.endswith("/__init__.py")
        module = path[:-len("/__init__.py")] if is_package else path[:-len(".py")]
        parts = module.split("/")
        todo += [f for i in range(1, len(parts)) if (f := "/".join(parts[:i]) + "/__init__.py") in files]
        source = _git(root, "show", f"{commit}:{path}").decode()
        for name in _imported_modules(source, module.replace("/", "."), is_package):
            if (f := _module_file(name, files)) is not None:
                todo.append(f)
    return sorted(seen)


def _commits_touching(root: Path, revs: str, paths: list[str]) -> list[tuple[str, _dt.datetime, list[str]]]:
    """(sha, committer date, paths among `paths` it changed) for each commit of `revs`."""
    out = _git(root, "log", "--format=%x01%H %cI", "--name-only", "--no-renames", revs, "--", *paths).decode()
    commits = []
    for block in out.split("\x01")[1:]:
        head, *names = block.strip().splitlines()
        sha, date = head.split()
        commits.append((sha, _dt.datetime.fromisoformat(date), sorted(set(names) & set(paths))))
    return commits


def audit_result(root: Path, path: Path) -> dict:
    """Whether the commit a result records can be the code that ran (module docstring)."""
    result = json.loads(path.read_text())
    rel = path.relative_to(root).as_posix()
    row = {"file": rel, "commit": result.get("commit"), "date": result.get("date"), "flags": []}
    recorded = str(result.get("commit", "")).removesuffix("+dirty")
    try:
        commit = _git(root, "rev-parse", "--verify", "--quiet", f"{recorded}^{{commit}}").decode().strip()
    except subprocess.CalledProcessError:
        row["flags"].append(f"recorded commit {recorded!r} is not in this repository")
        return row
    tree = set(_git(root, "ls-tree", "-r", "--name-only", commit).decode().splitlines())
    script = script_of(result.get("command", ""), tree)
    if script is None:
        row["flags"].append(f"no script of the command {result.get('command')!r} at {commit[:9]}")
        return row
    row["script"], row["script_files"] = script, script_files(root, commit, script)
    if is_dirty(result):
        row["flags"].append("ran on a dirty tree: the recorded commit plus an uncommitted diff")
    date = _dt.datetime.fromisoformat(result["date"])
    for sha, when, changed in _commits_touching(root, f"{commit}..HEAD", row["script_files"]):
        if when <= date:
            minutes = (date - when).total_seconds() / 60
            row["flags"].append(f"{sha[:9]} changed {', '.join(changed)} {minutes:.0f} min before the result "
                                f"was written, after the recorded commit")
    added = _git(root, "log", "--diff-filter=A", "--format=%H", "--", rel).decode().split()
    if added:
        changed = _commits_touching(root, f"{added[-1]}^!", row["script_files"])
        if changed and changed[0][2]:
            row["flags"].append(f"{added[-1][:9]}, the commit that added the result, also changed "
                                f"{', '.join(changed[0][2])}: the run may have used that change uncommitted")
    return row


def audit(root: Path = REPO_ROOT, results_dir: Path | None = None) -> list[dict]:
    """`audit_result` for every results/**/*.json that records a command and a commit."""
    paths = sorted((results_dir or root / "results").glob("**/*.json"))
    return [audit_result(root, p) for p in paths if {"command", "commit"} <= json.loads(p.read_text()).keys()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="action", required=True)
    sub.add_parser("stamp", help=f"write {STAMP_FILE} before sending the tree to a machine without .git")
    check = sub.add_parser("audit", help="results whose recorded commit is not the code that ran")
    check.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args()
    if args.action == "stamp":
        path = stamp()
        state = json.loads(path.read_text())
        print(f"wrote {path}: {state['commit']}{DIRTY_NOTE if state['dirty'] else ''}, {len(state['files'])} files")
        return
    for row in audit(REPO_ROOT, args.results_dir):
        print(f"{row['file']} (commit {row['commit']}, {row['date']}): {'ok' if not row['flags'] else 'FLAGGED'}")
        for flag in row["flags"]:
            print(f"    - {flag}")


if __name__ == "__main__":
    main()
