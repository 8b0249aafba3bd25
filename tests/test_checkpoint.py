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


def test_rng_round_trip(tmp_path):
    import random

    import numpy as np
    import torch

    ckpt.save_rng(tmp_path, rank=1)
    expected = (random.random(), float(np.random.rand()), torch.rand(3).tolist())
    random.seed(123), np.random.seed(123), torch.manual_seed(123)  # any other state
    ckpt.load_rng(tmp_path, rank=1)
    assert (random.random(), float(np.random.rand()), torch.rand(3).tolist()) == expected


def test_trainer_state_round_trip(tmp_path):
    """Trainer.state_dict -> trainer_state.pt -> Trainer.load_state_dict restores the loop's state exactly."""
    import torch

    from trapo.passrate import PassRateTracker, SelectionConfig
    from trapo.trainer import Trainer, TrainingError

    def skeleton(world):  # the state-holding part of a Trainer, without a model or an engine
        t = Trainer.__new__(Trainer)
        t.world, t.step, t.bad_steps, t.last_selection, t.best = world, 0, 0, None, None
        t.heldout_before = None
        t.tracker = PassRateTracker(torch.tensor([True, False, False]), SelectionConfig(warmup_epochs=1, top_p=0.5))
        return t

    a = skeleton(world=2)
    a.tracker.record(torch.arange(3), torch.tensor([0.5, 0.25, 1.0]), torch.tensor([float("nan"), 1.0, 0.0]))
    a.last_selection = a.tracker.end_epoch()
    a.step, a.bad_steps, a.best = 7, 1, {"step": 6, "score": 0.4}
    a.heldout_before = {"test": 0.25, "mean": 0.25}
    (tmp_path / ckpt.TRAINER_STATE).parent.mkdir(exist_ok=True)
    torch.save(a.state_dict(), tmp_path / ckpt.TRAINER_STATE)

    b = skeleton(world=2)
    b.load_state_dict(ckpt.read_trainer_state(tmp_path))
    assert (b.step, b.bad_steps, b.best, b.last_selection) == (7, 1, a.best, a.last_selection)
    assert b.heldout_before == a.heldout_before
    assert torch.equal(b.tracker.trajectories, a.tracker.trajectories)
    assert torch.equal(b.tracker.selected, a.tracker.selected) and torch.equal(b.tracker.scores, a.tracker.scores)
    with pytest.raises(TrainingError, match="saved with 2 ranks, resuming with 1"):
        skeleton(world=1).load_state_dict(ckpt.read_trainer_state(tmp_path))
