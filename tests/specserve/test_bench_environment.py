"""The bench's record of which code ran: the project's version and source hash, and a git commit only of
the project's own checkout ("unknown" for a copy of the tree without .git, even inside another repository)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from specserve.bench.environment import (
    GIT_COMMIT_ENV,
    UNKNOWN,
    environment,
    git_state,
    source_folders,
    source_sha256,
)


def _git(cwd, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def test_a_copy_without_git_inside_another_repository_records_unknown(tmp_path):
    outer = tmp_path / "other_repo"
    (outer / "copy").mkdir(parents=True)
    (outer / "copy" / "x.py").write_text("x = 1\n")
    _git(outer, "init", "-q")
    _git(outer, "add", ".")
    _git(outer, "commit", "-qm", "unrelated")
    assert git_state(outer / "copy") == {"commit": UNKNOWN, "dirty": None}  # was the enclosing repo's commit
    assert git_state(outer) == {"commit": _git(outer, "rev-parse", "HEAD"), "dirty": False}
    assert git_state(tmp_path) == {"commit": UNKNOWN, "dirty": None}  # no repository at all


def test_source_hash_follows_the_files_not_where_they_lie(tmp_path):
    a = tmp_path / "a" / "pkg"
    (a / "sub").mkdir(parents=True)
    (a / "m.py").write_text("x = 1\n")
    (a / "sub" / "s.proto").write_text("syntax = 'proto3';\n")
    b = tmp_path / "b" / "pkg"
    shutil.copytree(a, b)
    (b / "__pycache__").mkdir()
    (b / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"junk")
    (b / "notes.txt").write_text("not source")
    assert source_sha256([a]) == source_sha256([b])
    (b / "m.py").write_text("x = 2\n")
    assert source_sha256([a]) != source_sha256([b])


def test_environment_names_the_project_version_and_its_source_hash():
    env = environment("cpu")
    ours = env["specserve"]
    assert ours["version"] not in (None, UNKNOWN) and len(ours["source_sha256"]) == 64
    assert any((f / "bench" / "environment.py").is_file() for f in source_folders())
    assert env["git"]["commit"]  # this checkout's commit, or "unknown" on a copy without .git


def test_the_environment_names_the_commit_over_a_stale_git(tmp_path, monkeypatch):
    """SPECSERVE_GIT_COMMIT (what `git describe --always --dirty` printed where the tree was copied from) is what a
    summary records, whatever the copy's own .git says: the GPU machine's copy carries a stale one."""
    _git(tmp_path, "init", "-q")
    (tmp_path / "x.py").write_text("x = 1\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "stale")
    (tmp_path / "x.py").write_text("x = 2\n")
    assert git_state(tmp_path, {}) == {"commit": _git(tmp_path, "rev-parse", "HEAD"), "dirty": True}
    given = {"commit": "1fc4c0f", "dirty": False, "source": GIT_COMMIT_ENV}
    assert git_state(tmp_path, {GIT_COMMIT_ENV: "1fc4c0f"}) == given
    assert git_state(tmp_path / "none", {GIT_COMMIT_ENV: "1fc4c0f"}) == given  # a copy without .git too
    full = "471f688" + "0" * 33
    assert git_state(tmp_path, {GIT_COMMIT_ENV: f"{full}-dirty"}) == {**given, "commit": full, "dirty": True}
    assert git_state(tmp_path, {GIT_COMMIT_ENV: " 1FC4C0F\n"}) == given  # as a shell may hand it over
    assert git_state(tmp_path, {GIT_COMMIT_ENV: ""})["commit"] == _git(tmp_path, "rev-parse", "HEAD")  # unset
    monkeypatch.setenv(GIT_COMMIT_ENV, "1fc4c0f-dirty")
    assert environment("cpu")["git"] == {**given, "dirty": True}
    for bad in ("main", "1fc4c0", "1fc4c0f-clean", "1fc4c0f dirty", "1fc4c0g"):
        with pytest.raises(ValueError, match=f"^{GIT_COMMIT_ENV}: '{bad}' is not a commit"):
            git_state(tmp_path, {GIT_COMMIT_ENV: bad})
