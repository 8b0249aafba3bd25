"""Operator experience on the toy, end to end: a quiet terminal, loggers, rollout dumps, a SIGTERM-safe stop."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from toyrun import ROOT, STRAIGHT, VLLM, Ranks, free_port, metrics, overrides, train

from trapo import runtime
from trapo.training.loggers import read_wandb_history
from trapo.training.tensorboard_writer import read_histogram_tags, read_scalars

pytestmark = pytest.mark.toy_run  # every test here starts trainers (make test-fast leaves them out)


def at(row, key):
    """row["timing"]["rollout"] for "timing/rollout" (None when absent): a logged tag's metrics.jsonl value."""
    for part in key.split("/"):
        row = row.get(part) if isinstance(row, dict) else None
    return row


LOGGERS = {
    "logging.tensorboard": "true",
    "logging.wandb.enabled": "true",
    "logging.wandb.mode": "offline",
    "logging.mlflow.enabled": "true",
    "logging.rollouts_every": 1,
}


def test_quiet_terminal_loggers_and_rollout_dumps(toy_dir, tmp_path, monkeypatch):
    """TensorBoard, wandb (offline) and MLflow (file store) beside metrics.jsonl; a rollout dump every step."""
    # fresh: the libraries' import-time lines (DeepSpeed's accelerator warning) are among those checked
    out = train(overrides(toy_dir, tmp_path, max_steps=4, progress_bar="true", run_name="quiet", **LOGGERS), fresh=True)
    for line in out.stderr.replace("\r", "\n").splitlines():
        # our own lines and the progress bar only: no vLLM / DeepSpeed / torch messages
        assert not line.strip() or line.startswith("[trapo] ") or "it/s" in line or "%|" in line, line
    assert "trained 4 steps" in out.stdout
    log = (tmp_path / "quiet" / "log.txt").read_text()
    assert "WARNING" in log and "[trapo] mode trapo" in log  # the libraries' lines, with ours beside them
    assert "RotaryEmbedding: Failed to load weights" not in log  # benign, silenced at its source

    rows = metrics(tmp_path / "quiet")
    scalars = read_scalars(tmp_path / "quiet" / "tensorboard")
    assert [s for s, _ in scalars["loss"]] == [1, 2, 3, 4]
    assert [v for _, v in scalars["loss"]] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    assert [v for _, v in scalars["timing/rollout"]] == pytest.approx([r["timing"]["rollout"] for r in rows])
    assert scalars["selection/selected"] == [(4, rows[3]["selection"]["selected"])]  # epoch end at step 4
    # per epoch, from the selection.jsonl row
    assert scalars["selection_epoch/size"] == [(1, rows[3]["selection"]["selected"])]
    assert 1 in read_histogram_tags(tmp_path / "quiet" / "tensorboard")["selection_epoch/tcs"]

    # wandb and MLflow: the same values at the same steps; the epoch's selection at the step that closed it
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store only when told to
    run = tmp_path / "quiet"
    (wandb_run,) = (run / "wandb").glob("offline-run-*")
    history = read_wandb_history(wandb_run)
    client = MlflowClient((run / "mlruns").as_uri())
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("trapo").experiment_id])
    for key in ("loss", "pass_rate_unlabeled", "timing/rollout", "selection/selected"):
        expected = [(r["step"], at(r, key)) for r in rows if at(r, key) is not None]
        assert history[key] == expected, key
        assert [(m.step, m.value) for m in client.get_metric_history(mlflow_run.info.run_id, key)] == expected, key
    size = [(4, rows[3]["selection"]["selected"])]
    assert history["selection_epoch/size"] == size
    assert [
        (m.step, m.value) for m in client.get_metric_history(mlflow_run.info.run_id, "selection_epoch/size")
    ] == size

    # rollout dumps: each step's 16 questions with G = 8 responses, agreeing with the step's metrics
    for r in rows:
        dump = [json.loads(line) for line in (run / "rollouts" / f"step-{r['step']}.jsonl").read_text().splitlines()]
        assert len(dump) == 16 and len({d["question"] for d in dump}) == 16
        assert all(len(d["responses"]) == len(d["rewards"]) == len(d["answers"]) == 8 and d["prompt"] for d in dump)
        labeled, unlabeled = [d for d in dump if d["labeled"]], [d for d in dump if not d["labeled"]]
        assert (len(labeled), len(unlabeled)) == (r["labeled_questions"], r["unlabeled_questions"])
        assert sum(sum(d["rewards"]) / 8 for d in labeled) / len(labeled) == pytest.approx(r["reward_labeled"])
        assert sum(sum(d["rewards"]) / 8 for d in unlabeled) / len(unlabeled) == pytest.approx(r["reward_unlabeled"])
        assert sum(d["in_loss"] for d in unlabeled) == r["unlabeled_in_loss"] and all(d["in_loss"] for d in labeled)
        for d in labeled:  # a rewarded response has an answer; gold shown, no pseudo-label
            assert d["gold"] and d["pseudo_label"] is None and all(a for a, w in zip(d["answers"], d["rewards"]) if w)
        for d in unlabeled:  # majority reward: 1 exactly for the answers in the pseudo-label's cluster
            assert d["gold"] is None
            assert (d["pseudo_label"] is None) == (sum(d["rewards"]) == 0)
            assert all(a == d["pseudo_label"] for a, w in zip(d["answers"], d["rewards"]) if w)


@pytest.mark.xdist_group("straight_run")
def test_sigterm_saves_and_resumed_run_equals_uninterrupted(toy_dir, tmp_path, straight_run):
    common = {**STRAIGHT, "save_steps": 0}  # the checkpoint comes from the signal alone
    straight = metrics(straight_run)

    ranks = Ranks(overrides(toy_dir, tmp_path, run_name="stopped", **common))
    rows = tmp_path / "stopped" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (rows.is_file() and rows.read_text().count("\n") >= 1) and time.time() < deadline:
        time.sleep(0.05)
    ranks.procs[0].send_signal(signal.SIGTERM)  # during step 2 (or, at the latest, between steps)
    stopped = ranks.wait(timeout=300)
    err = stopped.stderr
    assert stopped.returncode == 75, err[-3000:]
    stopped_at = len(rows.read_text().splitlines())
    assert 1 <= stopped_at < 4
    assert f"stopped by a signal after step {stopped_at}" in err and f"step-{stopped_at}" in err
    assert os.path.isdir(tmp_path / "stopped" / "checkpoints" / f"step-{stopped_at}")

    out = train(overrides(toy_dir, tmp_path, run_name="stopped", resume_from="latest", **common))
    assert f"at step {stopped_at}" in out.stderr
    resumed = metrics(tmp_path / "stopped")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(straight, resumed):  # CPU fp32: the same rollouts, rewards and losses
        for key in ("loss", "pg_loss", "reward_labeled", "pass_rate_unlabeled", "response_tokens", "selection"):
            assert a.get(key) == b.get(key), (a["step"], key)
    assert json.loads((tmp_path / "stopped" / "summary.json").read_text())["steps"] == 4


def test_rollout_importance_correction_and_offload_switches(toy_dir, tmp_path):
    """loss.rollout_is (GPU default) and train.offload_during_rollout forced on, on CPU: weights ~1; the
    optimizer's fp32 master weights and Adam moments go to host buffers and come back exactly. Both runs
    also train GSPO with DAPO's soft overlong penalty; the first drops sequences by their geometric-mean
    ratio (sequence_mask), which on CPU fp32 is ~1 and drops none."""
    loss_options = {
        "loss.objective": "gspo",
        "loss.overlong": "soft_penalty",
        "rollout.max_tokens": 12,
        "loss.overlong_buffer": 11,
    }
    args = {
        "loss.rollout_is": "sequence_mask",
        "train.offload_during_rollout": "true",
        "max_steps": 3,
        "run_name": "is",
        **loss_options,
        **VLLM,
    }
    train(overrides(toy_dir, tmp_path, **args))
    plain = {**args, "loss.rollout_is": "off", "train.offload_during_rollout": "false", "run_name": "plain"}
    train(overrides(toy_dir, tmp_path, **plain))
    rows, plain = metrics(tmp_path / "is"), metrics(tmp_path / "plain")
    for row, ref in zip(rows, plain):
        # CPU fp32: vLLM and the trainer compute the same distribution, so pi_old / pi_engine ~ 1
        assert row["rollout_is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert row["rollout_is_capped_frac"] == 0.0
        assert row["rollout_is_masked_frac"] == 0.0 and row["rollout_is_masked_seq_frac"] == 0.0
        assert ref["rollout_is_masked_frac"] is None  # off: not computed
        # the sequence weights s_i are 1 to ~1e-7 (|log pi_old - log pi_engine| ~ 4e-7 per token): the runs agree
        # to float rounding, which an optimizer state that came back wrong would not
        assert not row["skipped"] and row["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert row["pg_loss"] == pytest.approx(ref["pg_loss"], rel=1e-5)
        assert "offload" not in ref
        # buffer 11 of 12: the penalty ramps from length 1, R_len = (1 - |y|) / 11, so its mean is
        # (1 - mean length) / 11
        mean_len = row["response_tokens"] / row["responses"]
        assert row["overlong_penalty_mean"] == pytest.approx((1 - mean_len) / 11, abs=1e-6)
        assert row["overlong_penalty_mean"] < 0 and row["clip_frac"] == 0.0  # on-policy: GSPO's s_i = 1
    # 12 bytes per parameter once Adam's moments exist (step 2 on), only the fp32 master (4) before
    assert rows[1]["offload"]["bytes"] == 3 * rows[0]["offload"]["bytes"] == rows[2]["offload"]["bytes"] > 0
    assert all(r["offload"]["offload_s"] > 0 and r["offload"]["reload_s"] > 0 for r in rows)


def test_ctrl_c_during_start_up_is_one_line_naming_what_was_written_and_exit_130(toy_dir, tmp_path):
    """SIGINT before the first step (here: once the run's log exists, while the libraries import and the model
    loads): no traceback on the terminal, one line saying what start-up wrote, SIGINT's exit status 130."""
    run_dir = tmp_path / "ctrlc"
    cmd = [sys.executable, "trapo_train.py", *overrides(toy_dir, tmp_path, run_name="ctrlc", max_steps=2)]
    # SIGINT at its default in the child (a pytest-xdist worker may ignore it, and a child inherits that)
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=runtime.subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 300
    while not (run_dir / "log.txt").is_file() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    os.kill(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines() == [
        f"[trapo] interrupted during start-up (before the first step): nothing written but .lock, log.txt in "
        f"{run_dir}; run the same command again to start"
    ], err[-3000:]
    assert out == "" and not (run_dir / "metrics.jsonl").exists()
    assert "KeyboardInterrupt" in (run_dir / "log.txt").read_text()  # where it was, for a bug report


def test_sigterm_to_a_deepspeed_job_stops_both_ranks_after_the_same_step(toy_dir, tmp_path):
    """SIGTERM to the whole process group (a Ctrl-C, a cluster's preemption), launched with deepspeed."""
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    args = overrides(toy_dir, tmp_path, run_name="two", max_steps=4)
    cmd = [launcher, "--num_gpus", "2", "--master_port", str(free_port()), "trapo_train.py", *args]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=runtime.subprocess_env(),  # the user's own script through the real launcher: each rank imports afresh
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    rows = tmp_path / "two" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (rows.is_file() and rows.read_text().count("\n") >= 1) and time.time() < deadline:
        time.sleep(0.05)
    # every process gets it; deepspeed's launch.py also forwards one to each rank (a duplicate)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=300)  # until the ranks, which share the pipes, have exited
    stopped_at = len(rows.read_text().splitlines())
    assert 1 <= stopped_at < 4 and f"stopped by a signal after step {stopped_at}" in err, err[-3000:]
    shards = os.listdir(tmp_path / "two" / "checkpoints" / f"step-{stopped_at}" / "ds")
    assert sum("model_states" in f for f in shards) == 2  # both ranks saved the same step

    train(overrides(toy_dir, tmp_path, run_name="two", max_steps=4, resume_from="latest"), nproc=2)
    assert [r["step"] for r in metrics(tmp_path / "two")] == [1, 2, 3, 4]


def test_a_resumed_run_continues_its_wandb_and_mlflow_runs(toy_dir, tmp_path, monkeypatch):
    """2 steps, then resume_from=latest to 4: one wandb run id (offline: two folders of it), one MLflow run whose
    history holds steps 1-4 once each; the ids in run_dir/trackers.json and in the checkpoint."""
    args = dict(run_name="tracked", save_steps=2, **LOGGERS)
    train(overrides(toy_dir, tmp_path, max_steps=2, **args))
    train(overrides(toy_dir, tmp_path, max_steps=4, resume_from="latest", **args))
    run = tmp_path / "tracked"
    ids = json.loads((run / "trackers.json").read_text())
    folders = sorted((run / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and {f.name.rsplit("-", 1)[1] for f in folders} == {ids["wandb"]}
    assert [sorted({s for s, _ in read_wandb_history(f)["loss"]}) for f in folders] == [[1, 2], [3, 4]]
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient((run / "mlruns").as_uri())
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("trapo").experiment_id])
    assert mlflow_run.info.run_id == ids["mlflow"] and mlflow_run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(ids["mlflow"], "loss")] == [1, 2, 3, 4]
    state = torch.load(run / "checkpoints" / "step-4" / "trainer_state.pt", weights_only=True)
    assert state["tracker_ids"] == ids
