"""bench/compare_commits.py: two revisions' builds of one model, timed in one process."""
import os
import subprocess

from bench.compare_commits import ROOT, WORKING_TREE, compare


def _worktrees() -> list:
    out = subprocess.run(["git", "-C", ROOT, "worktree", "list", "--porcelain"], capture_output=True, text=True,
                         check=True).stdout
    return [line for line in out.splitlines() if line.startswith("worktree ")]


def test_compare_commits_builds_each_revision_and_removes_its_worktree():
    before = _worktrees()
    found = compare("mlp_b1", ["HEAD", WORKING_TREE], rounds=2, repeat=5, threads=1)
    assert list(found) == ["HEAD", WORKING_TREE]
    for median, best, kernel_sum, kernels in found.values():
        assert 0 < best <= median and kernel_sum == sum(kernels) > 0
    # The same model and, in a clean checkout, the same code: the same kernels either way.
    assert len(found["HEAD"][3]) == len(found[WORKING_TREE][3])
    assert _worktrees() == before and os.path.isdir(ROOT)

