"""Every bench row names the commit it measured: a copied tree whose files differ from its
.git's HEAD (the device machine's copy kept a .git of an older commit) said that older
commit without a word."""

from __future__ import annotations

import subprocess

from jrl.bench import results


def git(repo, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


def repo_with_one_commit(tmp_path):
    git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git(tmp_path, "add", "a.py")
    git(tmp_path, "commit", "-q", "-m", "one")
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()


def test_the_commit_of_a_clean_checkout_is_its_head(tmp_path, monkeypatch):
    head = repo_with_one_commit(tmp_path)
    monkeypatch.setattr(results, "ROOT", str(tmp_path))
    monkeypatch.delenv("JRL_BENCH_COMMIT", raising=False)
    assert results.git_commit() == head


def test_a_tree_whose_tracked_files_differ_from_head_is_marked_dirty(tmp_path, monkeypatch):
    head = repo_with_one_commit(tmp_path)
    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "new.py").write_text("")  # untracked: not measured code of the commit either way
    monkeypatch.setattr(results, "ROOT", str(tmp_path))
    monkeypatch.delenv("JRL_BENCH_COMMIT", raising=False)
    assert results.git_commit() == f"{head}+dirty"


def test_the_environment_names_the_commit_of_a_copied_tree(tmp_path, monkeypatch):
    repo_with_one_commit(tmp_path)
    monkeypatch.setattr(results, "ROOT", str(tmp_path))
    monkeypatch.setenv("JRL_BENCH_COMMIT", "abc123")
    assert results.git_commit() == "abc123"


def test_rows_recorded_into_bench_results_do_not_make_the_tree_dirty(tmp_path, monkeypatch):
    # `--record` appends to the tracked bench/results/*.jsonl: the second row is of the same code
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "decode_step.jsonl").write_text("")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "one")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    (tmp_path / "bench" / "results" / "decode_step.jsonl").write_text("{}\n")
    monkeypatch.setattr(results, "ROOT", str(tmp_path))
    monkeypatch.delenv("JRL_BENCH_COMMIT", raising=False)
    assert results.git_commit() == head
