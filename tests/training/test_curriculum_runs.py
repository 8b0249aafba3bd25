"""sampling.curriculum=trajectory end to end on the toy (trapo/training/curriculum.py): saturated labeled questions
leave the epochs' batches and come back every m-th epoch, metrics.jsonl says so, and a run killed mid-epoch
(kill -9) resumes equal to the straight run; with dynamic sampling on 2 ranks and vLLM it trains and resumes
exactly too."""

import os
import signal
import time

import pytest
from toyrun import VLLM, Ranks, metrics, overrides, train

pytestmark = pytest.mark.toy_run

# The tiny toy has 16 labeled questions: batches of 8 let the curriculum skip (it skips in whole batches).
# k = 2 and m = 3 make skips and re-admissions happen within a few epochs.
CURRICULUM = {
    "mode": "trapo",
    "sampling.curriculum": "trajectory",
    "sampling.curriculum_window": 2,
    "sampling.curriculum_readmit_every": 3,
    "train.rollout_batch_size": 8,
    "train.update_batch_size": 8,
    "loss.entropy_coef": 0.0,  # with the bonus, batches of 8 make this toy ramble
}
UNTIMED = ("timing", "tokens_per_s")


def same_rows(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):  # CPU fp32: the same batches, rollouts, rewards, losses and curriculum
        assert {k: v for k, v in x.items() if k not in UNTIMED} == {k: v for k, v in y.items() if k not in UNTIMED}


def killed_after(args: list[str], run_dir, rows: int) -> None:
    """Start a training run and SIGKILL its whole process group once metrics.jsonl has `rows` rows."""
    ranks = Ranks(args)
    path = run_dir / "metrics.jsonl"
    try:
        while ranks.procs[0].poll() is None:
            if path.is_file() and len(path.read_text().splitlines()) >= rows:
                os.killpg(ranks.pgid, signal.SIGKILL)
                break
            time.sleep(0.1)
    finally:
        if ranks.procs[0].poll() is None:
            os.killpg(ranks.pgid, signal.SIGKILL)
    assert ranks.wait().returncode == -signal.SIGKILL, "the run ended before it was killed"


def test_curriculum_skips_saturated_labeled_questions_and_a_kill_mid_epoch_resumes_exactly(toy_dir, tmp_path):
    common = dict(max_steps=40, **CURRICULUM)
    train(overrides(toy_dir, tmp_path, run_name="straight", **common))
    rows = metrics(tmp_path / "straight")
    assert [r["step"] for r in rows] == list(range(1, 41))
    blocks = [r["curriculum"] for r in rows]
    assert max(b["skipped_labeled"] for b in blocks) >= 8, blocks  # whole batches of 8
    assert all(b["skipped_unlabeled"] == 0 for b in blocks)
    assert any(b["readmitted"] > 0 for b in blocks) and any("readmitted_rolled_out" in b for b in blocks)
    assert all(0 <= r["zero_advantage_frac"] <= 1 for r in rows)
    # an epoch has as many steps as its batches (64 questions less the skipped ones, in batches of 8), the
    # same block on each, and its last step closes it
    epochs = {}
    for r in rows:
        epochs.setdefault(r["epoch"], []).append(r)
    for epoch, members in list(epochs.items())[:-1]:  # the last one may be cut by max_steps
        block = dict(members[0]["curriculum"])
        assert block["epoch_batches"] == len(members) == (64 - block["skipped_labeled"]) // 8, epoch
        assert all(set(block.items()) <= set(m["curriculum"].items()) for m in members)
        assert "selection" in members[-1] and "readmitted_rolled_out" in members[-1]["curriculum"]
    assert any(b["epoch_batches"] < 8 for b in blocks)

    # kill -9 two steps after a checkpoint that sits inside an epoch (step 20, or the nearest such step: where
    # the epochs end depends on the CPU's float kernels), then resume: equal to the straight run
    stop = next(s for s in (20, 21, 19, 22, 18) if rows[s - 1]["epoch"] == rows[s]["epoch"])
    killing = overrides(toy_dir, tmp_path, run_name="killed", save_steps=stop, **common)
    killed_after(killing, tmp_path / "killed", rows=stop + 2)
    out = train(overrides(toy_dir, tmp_path, run_name="killed", save_steps=stop, resume_from="latest", **common))
    assert f"step-{stop} at step {stop}" in out.stderr
    same_rows(rows, metrics(tmp_path / "killed"))


def test_curriculum_with_dynamic_sampling_on_two_ranks_and_vllm_resumes_exactly(toy_dir, tmp_path):
    """2 ranks, vLLM, rollout.dynamic_sampling: refills consume the curriculum's shorter epochs;
    resumed from step 6 the steps after it equal the straight run's."""
    common = dict(
        max_steps=10,
        save_steps=6,
        **{**CURRICULUM, "sampling.curriculum_window": 1, "sampling.curriculum_readmit_every": 2},
        **{"rollout.dynamic_sampling": "true"},
        **VLLM,
    )
    train(overrides(toy_dir, tmp_path, run_name="ds", **common), nproc=2)
    rows = metrics(tmp_path / "ds")
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert any(r["curriculum"]["skipped_labeled"] > 0 for r in rows), [r["curriculum"] for r in rows]
    assert any(r["dynamic_sampling"]["extra_rounds"] > 0 for r in rows)
    for r in rows:  # a refill never crosses the epoch's end: its rounds fit in the curriculum's epoch
        assert r["dynamic_sampling"]["rounds"] <= r["curriculum"]["epoch_batches"]
    step6 = tmp_path / "ds" / "checkpoints" / "step-6"
    train(overrides(toy_dir, tmp_path, run_name="re", resume_from=step6, **common), nproc=2)
    same_rows(rows[6:], metrics(tmp_path / "re"))
