"""experiments/results_io.py: the code state a result records (git, stamp, environment), the result
names it refuses, and the audit's one status per result, on small git repositories built here."""
import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from experiments import results_io
from experiments.results_io import (
    REPO_ROOT,
    STAMP_FILE,
    audit,
    audit_table,
    check_result_name,
    code_state,
    git_state,
    stamp,
)

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
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", STAMP_FILE], cwd=REPO_ROOT, capture_output=True,
                             check=False)
    assert tracked.returncode != 0, f"{STAMP_FILE} is committed: git rm --cached {STAMP_FILE}"


def test_provenance_mark():
    assert results_io.provenance_mark({"dirty": True}) == " (dirty tree)"
    assert results_io.provenance_mark({"commit": "abc1234+dirty"}) == " (dirty tree)"  # the old writer's suffix
    assert results_io.provenance_mark({"dirty": False, "provenance_source": "git"}) == ""
    assert results_io.provenance_mark({"dirty": False, "provenance_source": "stamp"}) == ""
    for record in ({}, {"dirty": None}, {"dirty": False}, {"dirty": False, "provenance_source": "environment"}):
        assert results_io.provenance_mark(record) == " (provenance unknown)"   # no verified dirty flag


def test_written_results_record_the_code_state(tmp_path):
    record = json.loads(results_io.write_result("demo", "r", {"rows": []}, results_dir=tmp_path).read_text())
    assert {"commit", "dirty", "provenance_source"} <= record.keys()
    assert ("diff_sha256" in record) == (record["dirty"] is True and record["provenance_source"] == "git")


def test_a_failed_write_keeps_the_old_result_and_leaves_no_temp_file(tmp_path, monkeypatch):
    path = results_io.write_result("demo", "r", {"rows": [1]}, results_dir=tmp_path)
    before = path.read_text()

    def full_disk(self, text):
        self.open("w").write(text[:10])     # part of it written, then the disk is full
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError, match="No space left"):
        results_io.write_result("demo", "r", {"rows": [2]}, results_dir=tmp_path)
    assert path.read_text() == before and sorted(p.name for p in path.parent.iterdir()) == ["r.json"]


# ---- result names ------------------------------------------------------------------------------
BAD_NAMES = ["../../x", "a/b", "a\\b", "..", ".", "", "x/../../y"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_result_name_that_would_leave_its_folder_is_refused_before_anything_is_written(name, tmp_path):
    with pytest.raises(ValueError, match=r"results_name=.*plain file name.*e\.g\. results_name=my_run"):
        check_result_name(name, "results_name")
    with pytest.raises(ValueError, match=r"^name="):
        results_io.write_result("oom_thresholds", name, {"rows": []}, results_dir=tmp_path / "a" / "results")
    assert list(tmp_path.iterdir()) == []


def test_plain_result_names_pass():
    assert check_result_name("h200_kernels_v1.2-b") == "h200_kernels_v1.2-b"


def test_runs_and_studies_refuse_a_bad_name_before_their_run_folder_exists(tmp_path):
    from omegaconf import OmegaConf

    from experiments.harness import ExperimentRun
    from experiments.quality_protocol import check_study
    with pytest.raises(ValueError, match="^name='../../x'"):
        ExperimentRun("oom_thresholds", "../../x", {}, out_dir=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()
    study = OmegaConf.create({"n_eval": 2, "workers": 1, "sample_batch": 2, "seeds": [0], "results_name": "../x",
                              "n_train_eval": 0, "data": {"num_videos": 8}})
    with pytest.raises(ValueError, match="^results_name='../x'"):
        check_study(study)


# ---- audit -------------------------------------------------------------------------------------
def put(root: Path, name: str, sha: str | None, **record) -> None:
    """A result file results/e/<name>.json recording `sha` (None: no commit) and `record`."""
    write(root, {f"results/e/{name}.json": json.dumps({"command": "python run.py", "rows": [], **record,
                                                      **({} if sha is None else {"commit": sha})})})


def statuses(root: Path) -> dict[str, tuple[str, str]]:
    return {Path(r["file"]).stem: (r["status"], r["why"]) for r in audit(root)}


def test_audit_gives_each_result_one_status(repo):
    head = git(repo, "rev-parse", "HEAD")
    git(repo, "checkout", "-q", "-b", "side")
    side = commit(repo, {"code.py": "x = 3\n"}, "09:10")   # a commit never merged into HEAD's history
    git(repo, "checkout", "-q", "-")
    put(repo, "git", head, dirty=False, provenance_source="git")
    put(repo, "stamp", head[:7], dirty=False, provenance_source="stamp")
    put(repo, "dirty", head, dirty=True, provenance_source="git", diff_sha256="d" * 64)
    put(repo, "suffix", f"{head[:7]}+dirty")                                      # the old writer's mark
    put(repo, "stale", head, dirty=True, stamp_mismatch=["code.py"], provenance_source="stamp")
    put(repo, "no_flag", head)
    put(repo, "environment", head, dirty=False, provenance_source="environment")
    put(repo, "side", side, dirty=False, provenance_source="git")
    put(repo, "side_dirty", side, dirty=True, provenance_source="git")
    put(repo, "absent", "f" * 40, dirty=False, provenance_source="git")
    put(repo, "no_commit", None)
    put(repo, "never", "unknown", dirty=None, provenance_source="unknown")
    write(repo, {"results/e/corrupt.json": "{", "results/e/list.json": "[]"})
    absent = f"git cannot tell: commit {'f' * 40} is not in this repository (a shallow clone?) or is ambiguous"
    found = statuses(repo)
    status, why = found.pop("corrupt")
    assert status == "unverifiable" and why.startswith("not readable as JSON: ")
    assert found == {
        "git": ("ok", "clean (git)"), "stamp": ("ok", "clean (stamp)"),
        "dirty": ("dirty", "dirty flag (git)"), "suffix": ("dirty", "'+dirty' commit suffix"),
        "stale": ("dirty", "stale stamp: code.py changed"),
        "no_flag": ("unknown", "no dirty flag recorded"),
        "environment": ("unknown", "dirty=False from the environment source, not verified"),
        "side": ("not-an-ancestor", f"{side[:9]} is not in the history of HEAD"),
        "side_dirty": ("not-an-ancestor", f"{side[:9]} is not in the history of HEAD"),
        "absent": ("unverifiable", absent),
        "no_commit": ("unverifiable", "no commit recorded"), "never": ("unverifiable", "no commit recorded"),
        "list": ("unverifiable", "not a JSON object")}


def test_audit_says_so_where_git_is_missing(repo, monkeypatch):
    put(repo, "r", git(repo, "rev-parse", "HEAD"), dirty=False, provenance_source="git")
    monkeypatch.setenv("PATH", str(repo / "no_bin"))
    assert statuses(repo) == {"r": ("unverifiable", "git is not available here")}


def test_audit_table_counts_every_status_and_strict_fails_unless_all_ok(repo, monkeypatch, capsys):
    head = git(repo, "rev-parse", "HEAD")
    put(repo, "a", head, dirty=False, provenance_source="stamp", provenance_note="ran from a stamped copy")
    put(repo, "b", head)
    table = audit_table(audit(repo))
    assert table.splitlines()[1:] == [
        f"ok              results/e/a.json {head[:9]} stamp  clean (stamp); a provenance_note explains the run",
        f"unknown         results/e/b.json {head[:9]} -      no dirty flag recorded",
        "2 results: unverifiable 0, not-an-ancestor 0, dirty 0, unknown 1, ok 1"]
    monkeypatch.setattr(results_io, "REPO_ROOT", repo)
    for strict, code in ((False, 0), (True, 1)):
        monkeypatch.setattr("sys.argv", ["results_io", "audit", "--results-dir", str(repo / "results"),
                                         *(["--strict"] if strict else [])])
        try:
            results_io.main()
            exit_code = 0
        except SystemExit as stop:
            exit_code = stop.code
        assert exit_code == code and capsys.readouterr().out == table + "\n"
    (repo / "results/e/b.json").unlink()
    results_io.main()   # still --strict, every result ok: no exit status
    assert capsys.readouterr().out.endswith("1 results: unverifiable 0, not-an-ancestor 0, dirty 0, unknown 0, ok 1\n")


def test_ran_on_needs_every_gpu_of_the_result_to_be_that_gpu():
    def of(*gpus):
        return {"hardware": {"cpu": "x", "gpus": list(gpus)}}
    assert results_io.ran_on(of("NVIDIA H200"), "H200") and results_io.ran_on(of("NVIDIA H200", "NVIDIA H200"), "H200")
    assert not results_io.ran_on(of("NVIDIA H100 80GB HBM3"), "H200")
    assert not results_io.ran_on(of("NVIDIA H200", "NVIDIA H100 80GB HBM3"), "H200")
    assert not results_io.ran_on(of(), "H200") and not results_io.ran_on({}, "H200")   # CPU runs, no hardware
