"""rollout.placement separate on the toy: one training rank and one rollout rank (the deepspeed launcher's
2 processes, as a user starts them), against the colocated trainer; staleness 1, its kill -9, SIGTERM and
resumes, and a rollout rank that dies, each with either engine on the rollout rank (hf, vLLM). vLLM's
staleness 0 against the colocated vLLM trainer: test_separate_vllm_runs.py."""

import glob
import os
import signal

import pytest
from toyrun import NOT_COMPARED, VLLM, Ranks, metrics, overrides, rows, same_weights, selections, train, wait_rows

# every test here starts trainers (make test-fast leaves them out), each two processes at once
pytestmark = pytest.mark.toy_run
SHARED = pytest.mark.xdist_group("stale_run")  # the tests of the one stale_run: one xdist worker runs it once

RUN = dict(mode="trapo", max_steps=8, save_steps=2)
SEPARATE = {"rollout.placement": "separate", "rollout.ranks": 1}
ONLY_SEPARATE = {
    "pushed_gb",
    "rollout_staleness",
    "staleness_kl",
    "rollout_generate_s",
}  # hf colocated pushes nothing, lags nothing
NOISE = "logprob_diff_rollout_vs_policy"  # a mean of float rounding (~3e-7): kernels' last bits, not the run's


ENGINES = {"hf": {}, "vllm": VLLM}  # the rollout rank's engine (toyrun.overrides names hf)


@pytest.fixture(params=list(ENGINES))
def engine(request):
    """The rollout rank's engine settings, for each engine in turn."""
    return ENGINES[request.param]


@pytest.fixture(scope="module")
def stale_runs(toy_dir, tmp_path_factory):
    """engine settings -> the run directory of an uninterrupted separate run at rollout.max_staleness 1 with that
    engine on the rollout rank, run once on first use (tests of both engines may come in any order)."""
    runs = {}

    def run(engine: dict):
        key = tuple(sorted(engine.items()))
        if key not in runs:
            out = tmp_path_factory.mktemp("stale")
            train(overrides(toy_dir, out, run_name="stale", **stale_args(engine)), nproc=2)
            runs[key] = out / "stale"
        return runs[key]

    return run


@pytest.fixture
def stale_run(stale_runs, engine):
    return stale_runs(engine)


def stale_args(engine: dict) -> dict:
    return {**RUN, **SEPARATE, **engine, "rollout.max_staleness": 1}


def test_staleness_0_writes_what_the_colocated_trainer_writes(toy_dir, tmp_path):
    train(overrides(toy_dir, tmp_path, run_name="colocated", **RUN))
    train(overrides(toy_dir, tmp_path, run_name="separate", **RUN, **SEPARATE), nproc=2)  # hf: toyrun.overrides
    colocated, separate = tmp_path / "colocated", tmp_path / "separate"
    leave_out = NOT_COMPARED | ONLY_SEPARATE | {NOISE}
    assert rows(colocated, leave_out) == rows(separate, leave_out)  # loss, rewards, pass rates, gate...
    # the same tokens, scored in another process: their logprobs may differ in the last bits (seen on an AMD EPYC)
    assert [r[NOISE] for r in metrics(separate)] == pytest.approx([r[NOISE] for r in metrics(colocated)], rel=0.05)
    assert [row["rollout_staleness"] for row in metrics(separate)] == [0] * 8
    assert selections(colocated) == selections(separate)
    assert same_weights(colocated, separate)


@SHARED
def test_staleness_1_lags_one_update_and_corrects_it(stale_run):
    m = metrics(stale_run)
    assert [row["step"] for row in m] == list(range(1, 9)) and not any(row["skipped"] for row in m)
    assert [row["rollout_staleness"] for row in m] == [0] + [1] * 7  # round 1: the initial weights, as colocated
    assert all(row["rollout_is_weight_mean"] is not None for row in m)  # loss.rollout_is forced on (truncate)
    assert all(row["rollout_is_capped_frac"] is not None for row in m)
    assert abs(m[0]["staleness_kl"]) < 1e-5 < max(abs(row["staleness_kl"]) for row in m[1:])


def test_dynamic_sampling_prefetches_the_next_first_round_and_refills_fresh(toy_dir, tmp_path):
    dynamic = {"rollout.max_staleness": 1, "rollout.dynamic_sampling": "true", "rollout.dynamic_sampling_max_rounds": 2}
    train(overrides(toy_dir, tmp_path, run_name="dyn", **RUN, **SEPARATE, **dynamic), nproc=2)
    m = metrics(tmp_path / "dyn")
    assert [row["rollout_staleness"] for row in m] == [0] + [1] * (len(m) - 1)  # the first round is one behind
    assert any(row["dynamic_sampling"]["extra_rounds"] for row in m)  # refills ran (at staleness 0)
    assert not any(row["skipped"] for row in m)


@SHARED
def test_kill_9_after_step_5_then_resume_equals_the_straight_stale_run(toy_dir, tmp_path, engine, stale_run):
    args = overrides(toy_dir, tmp_path, run_name="killed", **stale_args(engine))
    ranks = Ranks(args, nproc=2)
    try:
        assert wait_rows(ranks.procs[0], tmp_path / "killed", 5), "no kill after step 5"
    finally:
        os.killpg(ranks.pgid, signal.SIGKILL)  # the training rank and the rollout rank
        ranks.wait()
    train([*args, "resume_from=latest"], nproc=2)
    assert rows(tmp_path / "killed") == rows(stale_run)
    assert selections(tmp_path / "killed") == selections(stale_run)
    assert same_weights(tmp_path / "killed", stale_run)


def test_a_dead_rollout_rank_stops_the_run_in_one_line_naming_it(toy_dir, tmp_path, engine):
    args = overrides(toy_dir, tmp_path, run_name="dead", **RUN, **SEPARATE, **engine, dist_timeout_minutes=1)
    # as a launcher starts them, without one that would stop the trainer once the rollout rank died
    ranks = Ranks(args, nproc=2)
    trainer, rollout = ranks.procs
    wait_rows(trainer, tmp_path / "dead", 2)
    rollout.send_signal(signal.SIGKILL)
    rollout.wait()
    trainer.wait(timeout=120)
    out = ranks.wait()  # both have ended: their output
    assert trainer.returncode == 3, out.stderr[-2000:]
    lines = [line for line in (out.stdout + out.stderr).splitlines() if "rollout link" in line]
    assert len(lines) == 1 and "rollout rank 0 (link rank 1) stopped answering" in lines[0], out.stdout + out.stderr
    done = sorted(glob.glob(str(tmp_path / "dead" / "checkpoints" / "step-*" / "COMPLETE")))
    assert done and not glob.glob(str(tmp_path / "dead" / "checkpoints" / ".*tmp*"))


@SHARED
def test_a_resume_on_two_training_ranks_feeds_the_saved_round(toy_dir, tmp_path, engine, stale_run):
    import shutil

    shutil.copytree(stale_run, tmp_path / "stale")
    for later in ("step-6", "step-8"):  # resume at step 4, whose checkpoint holds round 5 (generated by version 3)
        shutil.rmtree(tmp_path / "stale" / "checkpoints" / later)
    args = overrides(toy_dir, tmp_path, run_name="stale", **stale_args(engine))
    train([*args, "resume_from=latest"], nproc=3)  # 2 training ranks + the rollout rank
    moved, straight = metrics(tmp_path / "stale"), metrics(stale_run)
    assert [row["rollout_staleness"] for row in moved] == [0] + [1] * 7  # step 5: the saved round, not a new one
    for name in ("reward_labeled", "pass_rate_labeled", "pass_rate_unlabeled", "trained_sequences"):
        assert [row[name] for row in moved] == [row[name] for row in straight]
    assert all(abs(a["loss"] - b["loss"]) < 1e-6 for a, b in zip(moved, straight))  # 2 ranks reduce in another order


@SHARED
def test_sigterm_to_the_group_saves_the_round_in_flight_and_resumes_equal(toy_dir, tmp_path, engine, stale_run):
    import torch

    args = overrides(toy_dir, tmp_path, run_name="term", **stale_args(engine))
    ranks = Ranks(args, nproc=2)
    log = tmp_path / "term" / "metrics.jsonl"
    wait_rows(ranks.procs[0], tmp_path / "term", 3, poll=0.05)
    os.killpg(ranks.pgid, signal.SIGTERM)  # the training rank and the rollout rank
    err = ranks.wait(timeout=300).stderr
    stopped_at = len(log.read_text().splitlines())
    assert stopped_at < 8 and f"stopped by a signal after step {stopped_at}" in err, err[-3000:]
    state = torch.load(tmp_path / "term" / "checkpoints" / f"step-{stopped_at}" / "trainer_state.pt", weights_only=True)
    assert [version for _, version, _ in state["rounds_in_flight"]] == [stopped_at - 1]  # the next round, one behind
    train([*args, "resume_from=latest"], nproc=2)
    assert rows(tmp_path / "term") == rows(stale_run)
    assert same_weights(tmp_path / "term", stale_run)
