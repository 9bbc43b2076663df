"""The bench's record of which code ran: the project's version and source hash, and a git commit only of
the project's own checkout ("unknown" for a copy of the tree without .git, even inside another repository)."""

from __future__ import annotations

import shutil
import subprocess

from specserve.bench.environment import UNKNOWN, environment, git_state, source_folders, source_sha256


def _git(cwd, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout.strip()


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
