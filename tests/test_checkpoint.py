"""Checkpoint directories: only committed ones are visible; stale staging is cleaned."""

import pytest

from trapo import checkpoint as ckpt


def test_commit_latest_and_prune(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 10):
        tmp = ckpt.begin(root, step)
        (tmp / "payload").write_text("x")
        ckpt.commit(root, step)
    crashed = ckpt.begin(root, 12)  # written, never committed
    (crashed / "payload").write_text("half")
    assert [s for s, _ in ckpt.list_complete(root)] == [2, 4, 10]
    assert ckpt.resolve("latest", root).name == "step-10"
    assert ckpt.resolve(None, root) is None
    assert ckpt.resolve("latest", tmp_path / "empty") is None
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        ckpt.resolve(str(crashed), root)
    ckpt.prune(root, keep=2)
    assert [s for s, _ in ckpt.list_complete(root)] == [4, 10]
    ckpt.begin(root, 14)  # a new save removes the stale staging dir
    assert not crashed.exists()
