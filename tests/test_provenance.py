"""The commit a result records (`longstraw.measure.provenance.git_commit`, docs/gpu.md).

The GPU box receives a copy of the tree without `.git`, often inside some other repository: the
commit must then be LONGSTRAW_COMMIT when set, else "unknown" -- never the enclosing repo's HEAD.
Each case copies `longstraw/measure/provenance.py` into a throwaway tree and loads it from there, so the
module's `__file__` (which locates the repo root) is the copy's.
"""

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest

MEASURE = Path(__file__).resolve().parent.parent / "longstraw" / "measure" / "provenance.py"


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def make_repo(path: Path) -> str:
    """A git repo at `path` with one commit; returns its HEAD."""
    path.mkdir(parents=True, exist_ok=True)
    git(path, "init", "-q")
    (path / "file.txt").write_text("x\n")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "one")
    return git(path, "rev-parse", "HEAD")


def copy_package(root: Path):
    """`longstraw/measure/provenance.py` copied under `root` and imported from there."""
    (root / "longstraw" / "measure").mkdir(parents=True, exist_ok=True)
    target = root / "longstraw" / "measure" / "provenance.py"
    shutil.copy(MEASURE, target)
    spec = importlib.util.spec_from_file_location(f"measure_copy_{abs(hash(root))}", target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def git_env(monkeypatch):
    monkeypatch.delenv("LONGSTRAW_COMMIT", raising=False)
    for var in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE"):
        monkeypatch.delenv(var, raising=False)
    for var in ("GIT_AUTHOR_NAME", "GIT_COMMITTER_NAME"):
        monkeypatch.setenv(var, "test")
    for var in ("GIT_AUTHOR_EMAIL", "GIT_COMMITTER_EMAIL"):
        monkeypatch.setenv(var, "test@example.com")
    if shutil.which("git") is None:
        pytest.skip("git not installed")


def test_copy_inside_another_repo_records_unknown(tmp_path):
    outer_head = make_repo(tmp_path / "outer")
    measure = copy_package(tmp_path / "outer" / "device_copy")  # no .git of its own
    assert measure.git_commit() == "unknown"
    assert measure.provenance("cpu")["commit"] == "unknown"
    assert outer_head not in measure.git_commit()


def test_longstraw_commit_wins(tmp_path, monkeypatch):
    make_repo(tmp_path / "outer")
    copied = copy_package(tmp_path / "outer" / "device_copy")
    own_head = make_repo(tmp_path / "repo")
    in_repo = copy_package(tmp_path / "repo")
    assert in_repo.git_commit().startswith(own_head)
    monkeypatch.setenv("LONGSTRAW_COMMIT", "0123abcd")
    assert copied.git_commit() == "0123abcd"
    assert in_repo.git_commit() == "0123abcd"
    assert copied.provenance("cpu")["commit"] == "0123abcd"
    monkeypatch.setenv("LONGSTRAW_COMMIT", "")  # empty counts as unset
    assert copied.git_commit() == "unknown"


def test_a_variant_is_recorded_beside_the_commit(tmp_path, monkeypatch):
    measure = copy_package(tmp_path / "copy")
    monkeypatch.delenv("LONGSTRAW_VARIANT", raising=False)
    assert measure.provenance("cpu")["variant"] is None
    monkeypatch.setenv("LONGSTRAW_VARIANT", "dq")
    monkeypatch.setenv("LONGSTRAW_COMMIT", "0123abcd")
    recorded = measure.provenance("cpu")
    assert recorded["variant"] == "dq" and recorded["commit"] == "0123abcd"


def test_own_repo_records_its_head_and_dirty(tmp_path):
    make_repo(tmp_path / "outer")
    root = tmp_path / "outer" / "checkout"
    measure = copy_package(root)
    head = make_repo(root)  # commits provenance.py too
    assert measure.git_commit() == head
    (root / "file.txt").write_text("changed\n")
    assert measure.git_commit() == head + "-dirty"
    (root / "untracked.txt").write_text("new\n")  # untracked files do not count
    (root / "file.txt").write_text("x\n")
    assert measure.git_commit() == head


def test_worktree_git_file_counts(tmp_path):
    main = tmp_path / "main"
    copy_package(main)
    make_repo(main)
    git(main, "worktree", "add", "-q", "-b", "side", str(tmp_path / "wt"))
    worktree = tmp_path / "wt"
    assert (worktree / ".git").is_file()
    (worktree / "file.txt").write_text("side\n")
    git(worktree, "commit", "-q", "-am", "side")
    measure = copy_package(worktree)  # same content as committed: clean
    assert measure.git_commit() == git(worktree, "rev-parse", "HEAD")
    assert measure.git_commit() != git(main, "rev-parse", "HEAD")


def test_a_benchmark_result_is_written_and_printed_with_its_provenance(tmp_path, monkeypatch, capsys):
    from longstraw.measure.provenance import emit

    monkeypatch.setenv("LONGSTRAW_COMMIT", "0123abcd")
    out = tmp_path / "result.json"
    emit({"ratio": 2.5}, "cpu", out)
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == printed
    assert printed["ratio"] == 2.5 and printed["provenance"]["commit"] == "0123abcd"
    emit({"ratio": 1.0}, "cpu")  # no file asked for: printed only
    assert json.loads(capsys.readouterr().out)["ratio"] == 1.0 and sorted(tmp_path.iterdir()) == [out]
