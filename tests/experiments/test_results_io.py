"""experiments/results_io.py: the code state a result records (git, stamp, environment) and the
audit of recorded commits, on small git repositories built here with controlled commit dates."""
import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from experiments import results_io
from experiments.results_io import REPO_ROOT, STAMP_FILE, audit, code_state, git_state, script_files, stamp

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git(root: Path, *args: str, date: str = "2026-01-01T10:00:00+00:00") -> str:
    env = {"GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date, "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(root),
           "PATH": os.environ["PATH"]}
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, env=env,
                          capture_output=True, text=True, check=True).stdout.strip()


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def commit(root: Path, files: dict[str, str], when: str) -> str:
    write(root, files)
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", f"at {when}", date=f"2026-01-01T{when}:00+00:00")
    return git(root, "rev-parse", "HEAD")


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    git(root, "init", "-q")
    commit(root, {"code.py": "x = 1\n", ".gitignore": "*.log\n"}, "09:00")
    return root


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_clean_tree_records_the_full_commit(repo):
    assert git_state(repo) == {"commit": git(repo, "rev-parse", "HEAD"), "dirty": False}
    assert re.fullmatch("[0-9a-f]{40}", git_state(repo)["commit"])


def test_dirty_tree_hashes_git_diff_head_and_untracked_files(repo):
    (repo / "code.py").write_text("x = 2\n")
    diff = subprocess.run(["git", "diff", "HEAD", "--binary"], cwd=repo, capture_output=True, check=True).stdout
    assert git_state(repo)["diff_sha256"] == sha256(diff)
    (repo / "new.py").write_text("y = 3\n")
    listing = b"untracked new.py " + sha256(b"y = 3\n").encode() + b"\n"
    assert git_state(repo) == {"commit": git(repo, "rev-parse", "HEAD"), "dirty": True,
                               "diff_sha256": sha256(diff + listing)}


def test_results_ignored_files_and_the_stamp_leave_the_tree_clean(repo):
    write(repo, {"results/x/run.json": "{}", "run.log": "ignored", STAMP_FILE: "{}"})
    assert git_state(repo)["dirty"] is False


def test_stamp_is_verified_on_a_copy_without_git(repo, tmp_path):
    (repo / "code.py").write_text("x = 2\n")
    expected = git_state(repo)
    stamp(repo)
    copy = tmp_path / "sent"
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git"))
    assert code_state(copy) == {**expected, "provenance_source": "stamp"}
    assert code_state(repo) == {**expected, "provenance_source": "git"}  # git is asked where it can answer
    (copy / "code.py").write_text("x = 3\n")  # edited after stamping: the stamp is stale
    assert code_state(copy) == {"commit": expected["commit"], "dirty": True, "stamp_mismatch": ["code.py"],
                                "provenance_source": "stamp"}


def test_stamp_only_overrides_a_stale_git_copy(repo, tmp_path, monkeypatch):
    old = git(repo, "rev-parse", "HEAD")
    new = commit(repo, {"code.py": "x = 2\n"}, "09:30")
    stamp(repo)
    copy = tmp_path / "sent"  # the device's copy: today's files beside a .git still at the old commit
    shutil.copytree(repo, copy)
    git(copy, "reset", "-q", old)
    assert code_state(copy)["commit"] == old and code_state(copy)["dirty"] is True
    monkeypatch.setenv("MEGASLIDE_PROVENANCE", "stamp")
    assert code_state(copy) == {"commit": new, "dirty": False, "provenance_source": "stamp"}
    (copy / STAMP_FILE).unlink()
    with pytest.raises(RuntimeError, match="no .provenance.json"):
        code_state(copy)


def test_stamp_refuses_a_tracked_stamp_file(repo):
    commit(repo, {STAMP_FILE: "{}"}, "09:30")
    with pytest.raises(RuntimeError, match="never be committed"):
        stamp(repo)


def test_environment_then_unknown_without_git_or_stamp(tmp_path, monkeypatch):
    monkeypatch.delenv("MEGASLIDE_GIT_COMMIT", raising=False)
    assert code_state(tmp_path) == {"commit": "unknown", "dirty": None, "provenance_source": "unknown"}
    monkeypatch.setenv("MEGASLIDE_GIT_COMMIT", "a" * 40)
    monkeypatch.setenv("MEGASLIDE_GIT_DIRTY", "1")
    monkeypatch.setenv("MEGASLIDE_GIT_DIFF_HASH", "b" * 64)
    assert code_state(tmp_path) == {"commit": "a" * 40, "dirty": True, "diff_sha256": "b" * 64,
                                    "provenance_source": "environment"}


def test_the_stamp_file_is_never_committed():
    if not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git work tree")
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", STAMP_FILE], cwd=REPO_ROOT, capture_output=True)
    assert tracked.returncode != 0, f"{STAMP_FILE} is committed: git rm --cached {STAMP_FILE}"


def test_dirty_mark():
    assert results_io.dirty_note({"dirty": True}) == " (dirty tree)"
    assert results_io.dirty_note({"commit": "abc1234+dirty"}) == " (dirty tree)"  # the old writer's suffix
    assert results_io.dirty_note({"dirty": False}) == results_io.dirty_note({}) == ""


def test_written_results_record_the_code_state(tmp_path):
    record = json.loads(results_io.write_result("demo", "r", {"rows": []}, results_dir=tmp_path).read_text())
    assert {"commit", "dirty", "provenance_source"} <= record.keys()
    assert ("diff_sha256" in record) == (record["dirty"] is True and record["provenance_source"] == "git")


# ---- audit -------------------------------------------------------------------------------------
SCRIPT = {"exp/__init__.py": "", "exp/run.py": "import os\nfrom pkg import lib\n",
          "pkg/__init__.py": "", "pkg/lib.py": "from .util import f\n", "pkg/util.py": "def f(): return 1\n",
          "pkg/unused.py": "z = 0\n"}


def result(command: str, sha: str, when: str) -> str:
    return json.dumps({"command": command, "commit": sha, "date": f"2026-01-01T{when}:00+00:00", "rows": []})


def test_script_files_follow_absolute_and_relative_imports(repo):
    c1 = commit(repo, SCRIPT, "10:00")
    assert script_files(repo, c1, "exp/run.py") == ["exp/__init__.py", "exp/run.py", "pkg/__init__.py",
                                                    "pkg/lib.py", "pkg/util.py"]


def test_audit_flags_a_commit_that_is_not_the_code_that_ran(repo):
    c1 = commit(repo, SCRIPT, "10:00")
    c2 = commit(repo, {"pkg/util.py": "def f(): return 2\n", "pkg/unused.py": "z = 1\n"}, "10:20")
    # A: records c1 but was written at 10:30, after c2 changed a module its script imports
    c3 = commit(repo, {"results/e/a.json": result("python exp/run.py", c1[:7], "10:30"), "README": "a"}, "10:40")
    # B: records c2; the commit that adds it also changes pkg/lib.py
    c4 = commit(repo, {"results/e/b.json": result("python -m exp.run", c2, "10:35"),
                       "pkg/lib.py": "from .util import f  # changed\n"}, "10:50")
    # C: an absolute script path from another machine; nothing changed its files before 10:45
    write(repo, {"results/e/c.json": result("python /elsewhere/main/exp/run.py", c3, "10:45")})
    rows = {r["file"]: r for r in audit(repo)}
    assert rows["results/e/a.json"]["script"] == "exp/run.py"
    assert rows["results/e/a.json"]["flags"] == [
        f"{c2[:9]} changed pkg/util.py 10 min before the result was written, after the recorded commit"]
    assert rows["results/e/b.json"]["flags"] == [
        f"{c4[:9]}, the commit that added the result, also changed pkg/lib.py: the run may have used that "
        "change uncommitted"]
    assert rows["results/e/c.json"]["script"] == "exp/run.py" and rows["results/e/c.json"]["flags"] == []


def test_audit_flags_a_dirty_run_and_an_unknown_commit(repo):
    c1 = commit(repo, SCRIPT, "10:00")
    write(repo, {"results/e/d.json": json.dumps({**json.loads(result("python exp/run.py", c1, "10:05")),
                                                 "dirty": True}),
                 "results/e/u.json": result("python exp/run.py", "f" * 40, "10:05")})
    rows = {r["file"]: r["flags"] for r in audit(repo)}
    assert rows["results/e/d.json"] == ["ran on a dirty tree: the recorded commit plus an uncommitted diff"]
    assert rows["results/e/u.json"] == [f"recorded commit {'f' * 40!r} is not in this repository"]
