"""Provenance: a result's commit says when the code that produced it differed from the commit."""

import subprocess

from specdec.evidence import git_commit


def git(tree, *args):
    subprocess.run(["git", *args], cwd=tree, check=True, capture_output=True)


def test_commit_says_when_the_tree_differs_from_it(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECDEC_COMMIT", raising=False)
    tree = tmp_path / "package"
    tree.mkdir()
    (tree / "kernel.py").write_text("BLOCK = 64\n")
    (tmp_path / "notes.md").write_text("outside the tree\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    commit = git_commit(tree)
    assert commit and "+" not in commit
    (tree / "kernel.py").write_text("BLOCK = 16\n")
    assert git_commit(tree) == commit + "+changes"
    (tree / "kernel.py").write_text("BLOCK = 64\n")
    (tmp_path / "notes.md").write_text("changed, outside the tree\n")
    assert git_commit(tree) == commit


def test_no_checkout_no_commit(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECDEC_COMMIT", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    assert git_commit(tmp_path) is None


def test_a_commit_given_to_a_tree_without_its_git_is_used(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_COMMIT", "abc1234")
    assert git_commit(tmp_path) == "abc1234"
