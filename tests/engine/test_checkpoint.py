"""Checkpoint directories: only committed ones are visible; stale staging is cleaned."""

import pytest

from trapo.engine import checkpoint as ckpt


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
    """RunState.state_dict -> trainer_state.pt -> RunState.load_state_dict restores the loop's state exactly."""
    import dataclasses

    import torch

    from trapo.algorithm.acquisition import GroupVote
    from trapo.config import Config
    from trapo.engine.grading.verifier import MathVerifier
    from trapo.training.run_state import RunState
    from trapo.training.sampling import Cursor

    def skeleton(world):  # a Trainer's RunState, without a model or an engine
        cfg = Config()
        cfg.selection = dataclasses.replace(cfg.selection, warmup_epochs=1, top_p=0.5)
        cfg.loss.entropy_target = 0.3  # adaptive entropy control: its coefficient is trainer state
        cfg.labels = dataclasses.replace(cfg.labels, budget=1, acquire="care")  # labels bought, votes recorded
        return RunState(
            cfg,
            torch.tensor([True, False, False]),
            torch.tensor([True, True, True]),  # every gold held: each unlabeled one could be bought
            rank=1,  # the second of `world` ranks: it takes the second rank's grader memory
            world=world,
            steps_per_epoch=4,
            total_steps=8,
            policy=type("FullFineTuning", (), {"base": None})(),  # no LoRA base identity to compare
            tokenizer=None,
            verifier=MathVerifier(num_workers=1),  # started only if a request comes: none here
            rollouts=type("Colocated", (), {"state_dict": lambda self: {}})(),  # no round in flight
            model_commit=None,  # a local model directory: no hub commit to compare
        )

    a = skeleton(world=2)
    a.tracker.record(torch.arange(3), torch.tensor([0.5, 0.25, 1.0]), torch.tensor([float("nan"), 1.0, 0.0]))
    a.last_selection = a.tracker.end_epoch()
    a.labels.record(2, GroupVote(5, (3,)), labeled=False, right=False, n_right=0)
    a.labels.record(0, GroupVote(6, (2,)), labeled=True, right=True, n_right=6)
    a.tracker.add_labels(torch.tensor([1]))
    a.step, a.bad_steps, a.best = 7, 1, {"step": 6, "score": 0.4}
    a.cursor = Cursor(3, 1)  # dynamic sampling: refills consumed batches, the cursor ran ahead of the step
    a.heldout_before = {"test": 0.25, "mean": 0.25}
    a.heldout_avg_before = {"test": 0.375, "mean": 0.375}  # eval.heldout_k > 0: the avg@k before training
    a.tracker_ids = {"wandb": "w1d", "mlflow": "0a1b"}  # the wandb / MLflow runs the run continues
    a.entropy_control.update(0.1)  # 0.01 -> 0.012: below the target
    a.rambling.check(6, 0.0, 0.2, lambda: None), a.rambling.check(7, 0.5, 0.9, lambda: None)  # baseline 0.2, streak 1
    slow = {"answers": {"2^{2^{40}}": 5.0}, "pairs": [["1", "x^{99}", 5.0]]}  # what exhausted the timeout
    a.verifier.load_memory(slow)
    assert a.state_dict()["grader_memory"] == [slow]  # gathered from every rank (one here: no process group)
    (tmp_path / ckpt.TRAINER_STATE).parent.mkdir(exist_ok=True)
    state = a.state_dict()
    state["grader_memory"] = [{"answers": {}, "pairs": []}, slow]  # as two ranks gathered them
    ckpt.write_trainer_state(tmp_path, state)

    b = skeleton(world=2)
    b.load_state_dict(ckpt.read_trainer_state(tmp_path))
    assert (b.step, b.bad_steps, b.best, b.last_selection) == (7, 1, a.best, a.last_selection)
    assert b.verifier.memory() == slow
    assert b.heldout_before == a.heldout_before and b.cursor == Cursor(3, 1)
    assert b.heldout_avg_before == a.heldout_avg_before
    assert b.tracker_ids == {"wandb": "w1d", "mlflow": "0a1b"}
    assert b.entropy_control.coef == a.entropy_control.coef == 0.012
    assert (b.rambling.baseline, b.rambling.streak) == (0.2, 1)
    assert (b.rambling.looping, b.rambling.warned) == (0, 7)  # no loop so far; warned at step 7
    assert torch.equal(b.tracker.trajectories, a.tracker.trajectories)
    assert b.tracker.bought.tolist() == [False, True, False]
    assert b.labels.votes == {2: GroupVote(5, (3,))} and b.labels.calibration == a.labels.calibration
    assert torch.equal(b.tracker.selected, a.tracker.selected) and torch.equal(b.tracker.scores, a.tracker.scores)
    one = skeleton(world=1)  # saved on 2 ranks, resumed on 1 (trapo/engine/reshard.py moves the DeepSpeed state)
    one.rank = 0
    one.load_state_dict(ckpt.read_trainer_state(tmp_path))
    assert one.step == 7 and one.verifier.memory() == slow  # both ranks' memories, merged


def test_a_trainer_state_of_another_format_is_refused_in_one_line(tmp_path):
    """No release exists, so a state without this version's format number (or with another) is not read."""
    import torch

    ckpt.write_trainer_state(tmp_path, {"step": 3})
    assert ckpt.read_trainer_state(tmp_path) == {"step": 3, "format": ckpt.STATE_FORMAT}
    for stamp, written in (
        ({}, "no format number"),
        ({"format": ckpt.STATE_FORMAT + 1}, f"format {ckpt.STATE_FORMAT + 1}"),
    ):
        torch.save({"step": 3, **stamp}, tmp_path / ckpt.TRAINER_STATE)
        with pytest.raises(ckpt.CheckpointError) as err:
            ckpt.read_trainer_state(tmp_path)
        message = str(err.value)
        assert "\n" not in message and message.startswith(f"{tmp_path / ckpt.TRAINER_STATE}: {written}, ")
        assert f"reads trainer state format {ckpt.STATE_FORMAT} only" in message


def _committed(root, step, payload=b"x" * 1000):
    tmp = ckpt.begin(root, step)
    (tmp / "ds").mkdir()
    (tmp / "ds" / "shard.pt").write_bytes(payload)
    (tmp / "hf.safetensors").write_bytes(payload[::-1])
    return ckpt.commit(root, step)


def test_complete_marker_records_every_file_and_damage_is_named(tmp_path):
    import json
    import zlib

    root = tmp_path / "checkpoints"
    path = _committed(root, 4)
    marker = json.loads((path / ckpt.COMPLETE).read_text())
    assert marker == {
        "step": 4,
        "files": {"ds/shard.pt": [1000, zlib.crc32(b"x" * 1000)], "hf.safetensors": [1000, zlib.crc32(b"x" * 1000)]},
    }
    assert ckpt.damaged(path) is None
    shard = path / "ds" / "shard.pt"
    shard.write_bytes(b"x" * 999)  # truncated
    assert ckpt.damaged(path) == "ds/shard.pt: 999 bytes, 1000 written"
    shard.write_bytes(b"x" * 999 + b"y")  # same size, one byte flipped
    assert ckpt.damaged(path) == "ds/shard.pt: checksum differs from the one written"
    shard.unlink()
    assert ckpt.damaged(path) == "ds/shard.pt: missing"
    (path / ckpt.COMPLETE).write_text("4\n")  # written before checksums were kept: nothing to verify
    assert ckpt.damaged(path) is None


def test_latest_sets_a_damaged_checkpoint_aside_and_takes_the_newest_whole_one(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        _committed(root, step)
    (root / "step-6" / "ds" / "shard.pt").write_bytes(b"")
    (root / "step-4" / "hf.safetensors").write_bytes(b"z" * 1000)
    warnings = []
    assert ckpt.choose("latest", root, warn=warnings.append) == root / "step-2"
    assert sorted(p.name for p in root.iterdir()) == ["step-2", "step-4.damaged", "step-6.damaged"]  # none deleted
    assert "step-6 is damaged (ds/shard.pt: 0 bytes, 1000 written); set aside as step-6.damaged" in warnings[0]
    assert [s for s, _ in ckpt.list_complete(root)] == [2]
    _committed(root, 4)  # a later save of the same step; the damaged copy stays aside
    (root / "step-4" / "ds" / "shard.pt").write_bytes(b"")
    assert ckpt.choose("latest", root, warn=warnings.append) == root / "step-2"
    assert (root / "step-4.damaged-2").is_dir()
    (root / "step-2" / "ds" / "shard.pt").write_bytes(b"")
    with pytest.raises(ckpt.CheckpointError, match="is damaged"):  # an explicit path is never replaced
        ckpt.choose(str(root / "step-2"), root)
    with pytest.raises(ckpt.CheckpointError, match="every checkpoint under .* is damaged"):
        ckpt.choose("latest", root, warn=warnings.append)


def test_partials_are_removed_and_reported(tmp_path):
    root = tmp_path / "checkpoints"
    _committed(root, 2)
    ckpt.begin(root, 4)
    assert ckpt.remove_partials(root) == [root / ".step-4.tmp"]
    assert sorted(p.name for p in root.iterdir()) == ["step-2"]


@pytest.mark.parametrize("small_disk", ["2m"], indirect=True)  # a real 2 MB filesystem (conftest)
def test_a_save_that_will_not_fit_is_refused_before_writing(tmp_path, small_disk):
    import shutil

    root = (small_disk or tmp_path) / "checkpoints"
    root.mkdir()
    if small_disk is not None:  # two 700 KB checkpoints on 2 MB: a third does not fit
        for step in (2, 4):
            _committed(root, step, payload=bytes(350_000))
        assert ckpt.space_problem(root, 6, estimate=1, keep=2) is not None
        msg = ckpt.space_problem(root, 6, estimate=1, keep=2)
        assert "needs about 700.1 KB (the size of step-4)" in msg  # its files and its COMPLETE marker
        assert "with 2 checkpoints kept (keep_checkpoints=2): nothing was written" in msg
        ckpt.prune(root, keep=1)
        assert ckpt.space_problem(root, 6, estimate=1, keep=1) is None
    free = shutil.disk_usage(root).free
    assert ckpt.space_problem(root / "fresh", 2, estimate=free + 1, keep=None).startswith(
        "checkpoint step-2 needs about"
    )
    assert "an estimate from the parameter count" in ckpt.space_problem(root / "fresh", 2, estimate=free + 1, keep=None)
    assert ckpt.space_problem(root / "fresh", 2, estimate=1, keep=None) is None
    assert not (root / "fresh" / ".step-2.tmp").exists()  # nothing written


def test_describe_names_a_full_disk_whichever_layer_reports_it(tmp_path):
    import errno

    err = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x"))
    assert ckpt.describe(err, tmp_path).startswith("the disk is full (No space left on device")
    zip_error = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 3812928 vs 3812816")
    assert ckpt.describe(zip_error, tmp_path).startswith("RuntimeError: [enforce fail")  # this disk has room


def test_state_files_load_without_unpickling_code(tmp_path):
    """trainer_state.pt / rng files hold tensors and plain values (weights_only=True); a file with a
    pickled object is refused with a message, not executed; an older rng file (NumPy arrays) still loads."""
    import random

    import numpy as np
    import torch

    ckpt.save_rng(tmp_path, rank=0)
    torch.load(tmp_path / "rng" / "rank-0.pt", weights_only=True)  # no allow-list needed
    old = tmp_path / "old"
    (old / "rng").mkdir(parents=True)
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(), "cuda": None}
    torch.save(state, old / "rng" / "rank-0.pt")  # the format before this change
    expected = (random.random(), float(np.random.rand()))
    random.seed(1), np.random.seed(1)
    ckpt.load_rng(old, rank=0)
    assert (random.random(), float(np.random.rand())) == expected

    class Payload:
        def __reduce__(self):
            return (open, (str(tmp_path / "ran"), "w"))

    torch.save({"step": 1, "x": Payload()}, tmp_path / ckpt.TRAINER_STATE)
    with pytest.raises(ckpt.CheckpointError, match="holds pickled objects that this trainer does not load"):
        ckpt.read_trainer_state(tmp_path)
    assert not (tmp_path / "ran").exists()
