"""End to end on the toy model, on CPU, with the real stack (DeepSpeed ZeRO-3, vLLM or the hf backend,
Math-Verify). Runs generate with the hf backend (toyrun.overrides) unless they test what vLLM does (VLLM).

Each run is a subprocess (a trainer owns a process: its distributed world and its rollout engine).
"""

import json
import math
import os
import subprocess
import sys

import pytest
from toyrun import ROOT, SCENARIO, STRAIGHT, TOY, VLLM, free_port, metrics, overrides, run, train

from trapo import runtime

pytestmark = pytest.mark.toy_run  # every test here starts trainers (make test-fast leaves them out)


# Each baseline mode, each switch riding along on one of them: gradient checkpointing,
# bf16 on CPU, the three confidence rewards, and two optimizer updates per rollout batch.
MODES = {
    "supervised": {"model.gradient_checkpointing": "true"},
    "unsupervised": {"model.dtype": "bfloat16", "reward.unlabeled": "token_entropy"},
    "naive_semi": {"reward.unlabeled": "self_certainty"},
    "naive_semi_two_updates": {"reward.unlabeled": "sentence_entropy", "train.update_batch_size": 8},
}


@pytest.mark.parametrize("name", list(MODES))
def test_baseline_modes_one_process(toy_dir, tmp_path, name):
    mode = name.replace("_two_updates", "")
    out = train(overrides(toy_dir, tmp_path, mode=mode, max_steps=2, run_name=name, **MODES[name]))
    chosen = "on (model.gradient_checkpointing=true)" if mode == "supervised" else "off (auto: no GPU"
    assert f"gradient checkpointing: {chosen}" in out.stderr  # said once at start-up
    assert out.stderr.count("gradient checkpointing:") == 1
    m = metrics(tmp_path / name)
    assert [r["step"] for r in m] == [1, 2] and not any(r["skipped"] for r in m)
    assert all(math.isfinite(r["loss"]) for r in m)
    if mode == "supervised":
        assert all(r["unlabeled_questions"] == 0 and r["labeled_questions"] == 16 for r in m)
    elif mode == "unsupervised":
        assert all(r["labeled_questions"] == 0 and r["unlabeled_in_loss"] == 16 for r in m)
        assert all(r["pseudo_label_precision"] is not None for r in m)  # hidden golds: diagnostics only
        # the reward trained on: minus the mean token entropy, not the majority agreement
        assert all(r["reward_unlabeled"] < 0 for r in m)
    else:
        assert all(r["labeled_questions"] + r["unlabeled_in_loss"] == 16 for r in m)
        assert all(r["trained_sequences"] == 16 * 8 for r in m)
    hf = tmp_path / name / "checkpoints" / "step-2" / "hf"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(hf))
    summary = json.loads((tmp_path / name / "summary.json").read_text())
    assert 0 <= summary["heldout_accuracy_after"] <= 1


def test_authors_verl_loss_settings_with_a_reference_model(toy_dir, tmp_path):
    """configs/trapo_1k_3k_verl.yaml's loss section on the toy: the KL to a ZeRO-3 reference copy."""
    import yaml

    loss = yaml.safe_load(open(os.path.join(ROOT, "configs", "trapo_1k_3k_verl.yaml")))["loss"]
    assert (loss["agg"], loss["advantage_scale"], loss["beta"], loss["entropy_coef"]) == (
        "token_mean",
        "std",
        0.001,
        0.0,
    )
    kv = {f"loss.{k}": v for k, v in loss.items()}
    train(overrides(toy_dir, tmp_path, mode="trapo", max_steps=3, run_name="verl", **{"train.lr": 1e-3}, **kv))
    m = metrics(tmp_path / "verl")
    assert all(math.isfinite(r["loss"]) and not r["skipped"] for r in m)
    # step 1 trains the initial weights: the policy is the reference, so the KL is 0 up to float noise
    assert m[0]["kl_ref"] < 1e-6 and m[0]["entropy"] > 0.0  # no entropy bonus, but measured (the rambling guard)
    # after the first step with a learning signal (a step whose rewards are all equal has none) the
    # policy has left the reference, and the KL says so
    moved = next(i for i, r in enumerate(m) if r["pg_loss"] != 0.0)
    assert moved < 2 and all(r["kl_ref"] > 1e-5 for r in m[moved + 1 :])


def test_trapo_two_processes_gate_and_selection(toy_dir, tmp_path):
    """2 ranks on CPU: warm-up is labeled-only, then the selection opens the gate."""
    val = os.path.join(toy_dir, "seed-0", "test.jsonl")
    extra = {"eval.files": f"[{val}]", "eval.steps": 3, "eval.n": 2, "keep_checkpoints": 1, "logging.rollouts_every": 5}
    extra["eval.heldout_k"] = 2  # the held-out avg@2 at eval.temperature, before and after, pooled over both ranks
    out = train(overrides(toy_dir, tmp_path, mode="trapo", max_steps=6, run_name="two", **extra), nproc=2)
    m = metrics(tmp_path / "two")
    assert [r["step"] for r in m] == [1, 2, 3, 4, 5, 6]
    warmup, after = m[:4], m[4:]
    for r in warmup:  # epoch 1 (4 steps of 16 of 64 questions) is the warm-up: M = 0 for unlabeled
        assert r["unlabeled_in_loss"] == 0
        assert r["trained_sequences"] == r["labeled_questions"] * 8
    sel = m[3]["selection"]
    assert sel["epoch"] == 1 and sel["unlabeled"] == 48 and sel["selected"] >= 4  # top-p 0.1 of 48
    assert sum(r["unlabeled_in_loss"] for r in after) > 0
    (dump,) = [json.loads(x) for x in (tmp_path / "two" / "selection.jsonl").read_text().splitlines()]
    assert dump["epoch"] == 1 and len(dump["tcs"]) == 48 and sum(dump["selected"]) == sel["selected"]
    for r in after:
        assert r["trained_sequences"] == (r["labeled_questions"] + r["unlabeled_in_loss"]) * 8
    # the step-5 rollout dump: both ranks' questions on rank 0, the gate open for the selected ones
    assert os.listdir(tmp_path / "two" / "rollouts") == ["step-5.jsonl"]
    rows = [json.loads(x) for x in (tmp_path / "two" / "rollouts" / "step-5.jsonl").read_text().splitlines()]
    assert len({r["question"] for r in rows}) == 16 and all(len(r["responses"]) == 8 for r in rows)
    assert sum(r["in_loss"] for r in rows if not r["labeled"]) == m[4]["unlabeled_in_loss"] > 0
    selected = {q for q, s in zip(dump["question"], dump["selected"]) if s}  # epoch 1's selection: epoch 2's gate
    assert all(r["in_loss"] == (r["labeled"] or r["question"] in selected) for r in rows)
    assert sum(r["labeled"] for r in rows) == m[4]["labeled_questions"]
    ds = os.listdir(tmp_path / "two" / "checkpoints" / "step-6" / "ds")
    assert sum("model_states" in f for f in ds) == 2  # one ZeRO-3 shard per rank
    assert "held-out accuracy" in out.stdout
    # validation every 3 steps on both ranks' shares; the best step's checkpoint survives pruning
    assert "eval" in m[2] and "eval" in m[5] and "eval" not in m[3]
    scores = [m[2]["eval"]["mean"], m[5]["eval"]["mean"]]
    best = json.loads((tmp_path / "two" / "best.json").read_text())
    assert best["score"] == max(scores) and best["step"] == (3 if scores[0] >= scores[1] else 6)
    # the held-out avg@2 after training is step 6's validation: the same questions, n, temperature, seeds, weights
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["heldout_avg"]["k"] == 2 and summary["heldout_avg_after"] == scores[1]
    assert 0 <= summary["heldout_avg_before"] <= 1 and "held-out avg@2 (temperature 0.6) before training" in out.stderr
    assert f"held-out avg@2 (temperature 0.6): {summary['heldout_avg_before']:.3f} before" in out.stdout
    assert os.path.isdir(best["checkpoint"]) and os.path.isdir(tmp_path / "two" / "checkpoints" / "step-6")


def test_packed_micro_batches_equal_padded_ones_under_zero3(toy_dir):
    """The real Policy (DeepSpeed ZeRO-3, chunked LM head): log-probs, entropies, loss and every full
    gradient of 24 sequences (3 to ~200 tokens), packed vs padded, to fp32 tolerance."""
    out = run([sys.executable, SCENARIO, "packed_vs_padded", f"toy.dir={toy_dir}", *TOY])
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["tokens"] > 300 and min(r["microbatches"]) >= 2
    assert r["logprob"] < 1e-4 and r["entropy"] < 1e-4
    assert r["loss"] <= 1e-6 * abs(r["loss_value"]) + 1e-9
    assert r["grad"] < 1e-5 * max(r["grad_scale"], 1.0)


def test_persistent_parameters_give_the_update_that_gathering_per_module_gives(toy_dir, tmp_path):
    """train.param_persistence=true (the memory plan's choice on one GPU where the model fits): DeepSpeed keeps
    every parameter persistent, and the update's log-probs, loss and full gradients are those of ZeRO-3
    gathering and releasing each module (a threshold of 0 here: the toy's parameters are all under the default)."""
    ds = json.loads(open(os.path.join(ROOT, "configs", "deepspeed_zero3.json")).read())
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    args = [f"toy.dir={toy_dir}", *TOY, f"train.deepspeed_config={tmp_path / 'ds.json'}"]
    out = run([sys.executable, SCENARIO, "persistent_vs_gathered", *args])
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["persistent_share"] == [0.0, 1.0]
    assert r["logprob"] == 0.0 and r["entropy"] == 0.0 and r["loss"] == 0.0
    assert r["grad"] == 0.0


def test_two_ranks_packed_balanced_skipping_equal_todays_update(toy_dir, tmp_path):
    """2 ranks, one step, entropy and KL terms off: packing + rank balancing + skipping zero-advantage
    sequences give the same loss and the same updated weights as right-padded, unbalanced, unskipped."""
    from safetensors.torch import load_file

    common = dict(mode="trapo", max_steps=1, save_steps=1, **{"loss.entropy_coef": 0.0})
    today = {"train.packing": "false", "train.balance_ranks": "false", "train.skip_zero_advantage": "false"}
    train(overrides(toy_dir, tmp_path, run_name="today", **common, **today), nproc=2)
    train(overrides(toy_dir, tmp_path, run_name="new", **common), nproc=2)
    (a,), (b,) = metrics(tmp_path / "today"), metrics(tmp_path / "new")
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-8)
    assert a["pg_loss"] == pytest.approx(b["pg_loss"], rel=1e-5, abs=1e-8)
    assert b["trained_sequences"] < a["trained_sequences"]  # groups with equal rewards were skipped
    for r in (a, b):
        parts = ("update_efficiency", "padding_share", "imbalance_share", "zero_signal_share")
        assert sum(r[k] for k in parts) == pytest.approx(1.0)
    assert b["padding_share"] == 0.0 and b["zero_signal_share"] == 0.0 and a["zero_signal_share"] > 0.0
    assert b["update_efficiency"] > a["update_efficiency"]
    wa, wb = (
        load_file(str(tmp_path / n / "checkpoints" / "step-1" / "hf" / "model.safetensors")) for n in ("today", "new")
    )
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-6


def test_eval_cli_writes_outputs_and_resumes_without_regenerating(toy_dir, tmp_path):
    model = os.path.join(toy_dir, "seed-0", "model")
    test = os.path.join(toy_dir, "seed-0", "test.jsonl")
    args = [
        sys.executable,
        "-m",
        "trapo",
        "eval",
        "--model",
        model,
        "--benchmarks",
        f"{test},aime",
        "--limit",
        "6",
        "--n",
        "2",
        "--pass-k",
        "2",
        "--template",
        "plain",
        "--max-tokens",
        "8",
        "--max-prompt-tokens",
        "1200",
        "--out",
        str(tmp_path / "ev"),
    ]
    first = run(args)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "generated 12 questions, reused 0" in first.stderr
    # the terminal gets the table and one closing line (no progress bar: stderr is a pipe here, not a tty);
    # vLLM's and torch's logs go to log.txt
    noise = [
        line
        for line in (first.stdout + first.stderr).splitlines()
        if any(w in line for w in ("FutureWarning", "UserWarning", "WARNING", "INFO"))
    ]
    assert noise == [], noise[:5]
    assert "\r" not in first.stderr and "WARNING" in (tmp_path / "ev" / "log.txt").read_text()
    assert "| Model | AIME24 | ID Avg. | test |" in first.stdout
    lines = (tmp_path / "ev" / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 12
    rec = json.loads(lines[0])
    assert len(rec["responses"]) == 2 and {"text", "answer", "correct", "tokens"} <= set(rec["responses"][0])
    results = json.loads((tmp_path / "ev" / "results.json").read_text())["results"]
    assert results["aime"]["questions"] == 6 and results["aime"]["samples"] == 2
    assert set(results["test"]["metrics"]) == {"avg@2", "pass@2"}
    assert (tmp_path / "ev" / "results.md").read_text() in first.stdout

    # interrupted: 5 questions done and a torn line; the rerun generates only the other 7
    (tmp_path / "ev" / "samples.jsonl").write_text("\n".join(lines[:5]) + "\n" + lines[5][:40])
    second = run(args)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "generated 7 questions, reused 5" in second.stderr
    again = (tmp_path / "ev" / "samples.jsonl").read_text().splitlines()
    assert again[:5] == lines[:5] and len(again) == 12
    assert sorted(again) == sorted(lines)  # same seeds: the same responses
    resumed = json.loads((tmp_path / "ev" / "results.json").read_text())["results"]
    assert {k: v["metrics"] for k, v in resumed.items()} == {k: v["metrics"] for k, v in results.items()}

    third = run(args)
    assert "generated 0 questions, reused 12" in third.stderr
    other = run([*args[:-2], "--temperature", "1.0", "--out", str(tmp_path / "ev")])
    assert other.returncode == 2 and "holds an evaluation with other settings" in other.stderr


@pytest.mark.xdist_group("straight_run")
def test_resume_after_kill_during_save_matches_uninterrupted(toy_dir, tmp_path, straight_run):
    common = STRAIGHT
    straight = metrics(straight_run)

    crashed = run(
        [sys.executable, SCENARIO, "crash_at_commit", "4", *overrides(toy_dir, tmp_path, run_name="resumed", **common)]
    )
    assert crashed.returncode == -9, crashed.stderr[-3000:]
    ckpts = tmp_path / "resumed" / "checkpoints"
    assert sorted(os.listdir(ckpts)) == [".step-4.tmp", "step-2"]  # written but never committed

    out = train(overrides(toy_dir, tmp_path, run_name="resumed", resume_from="latest", **common))
    assert "resumed from" in out.stderr and "step-2 at step 2" in out.stderr
    assert sorted(os.listdir(ckpts)) == ["step-2", "step-4"]
    resumed = metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    summaries = [json.loads((d / "summary.json").read_text()) for d in (straight_run, tmp_path / "resumed")]
    assert summaries[1]["heldout_before"] == summaries[0]["heldout_before"] is not None  # kept in the checkpoint
    for a, b in zip(straight, resumed):  # CPU fp32: the same rollouts, rewards and losses
        for key in ("loss", "pg_loss", "reward_labeled", "pass_rate_unlabeled", "response_tokens", "selection"):
            assert a.get(key) == b.get(key), (a["step"], key)


@pytest.mark.xdist_group("straight_run")
def test_full_disk_stops_cleanly_and_a_damaged_latest_falls_back_both_resuming_exactly(
    toy_dir, tmp_path, small_disk, straight_run
):
    """The disk fills during the step-4 save: one line naming the cause and step-2, status 74, no partial
    left, the traceback in log.txt; with space back, resume_from=latest equals an uninterrupted run. Then a
    truncated shard in step-4: it is set aside, step-2 is resumed, and the run again equals the straight one."""
    common = STRAIGHT
    straight = metrics(straight_run)

    def same_as_straight(run_dir):
        rows = metrics(run_dir)
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        for a, b in zip(straight, rows):  # CPU fp32: the same rollouts, rewards and losses
            for key in ("loss", "pg_loss", "reward_labeled", "pass_rate_unlabeled", "response_tokens", "selection"):
                assert a.get(key) == b.get(key), (a["step"], key)

    out_dir = small_disk or tmp_path / "disk"
    args = overrides(toy_dir, out_dir, run_name="full", **common)
    full = run([sys.executable, SCENARIO, "disk_full", "4", str(small_disk or "simulate"), *args])
    assert full.returncode == 74, full.stderr[-3000:]
    assert "Traceback" not in full.stderr
    said = [line for line in full.stderr.splitlines() if "was not saved" in line]
    assert len(said) == 1 and "checkpoint step-4 was not saved: the disk is full" in said[0], full.stderr[-2000:]
    assert "last good: " + str(out_dir / "full" / "checkpoints" / "step-2") in said[0]
    ckpts = out_dir / "full" / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["step-2"]  # the partial step-4 removed, step-2 kept
    assert "Traceback" in (out_dir / "full" / "log.txt").read_text()
    if small_disk is not None:
        os.remove(small_disk / "filler")

    out = train(overrides(toy_dir, out_dir, run_name="full", resume_from="latest", **common))
    assert "step-2 at step 2" in out.stderr
    same_as_straight(out_dir / "full")

    shard = max((ckpts / "step-4" / "ds").rglob("*"), key=lambda f: f.stat().st_size if f.is_file() else 0)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # as an interrupted copy leaves it
    out = train(overrides(toy_dir, out_dir, run_name="full", resume_from="latest", **common))
    assert f"step-4 is damaged (ds/{shard.relative_to(ckpts / 'step-4' / 'ds')}: " in out.stderr
    assert "set aside as step-4.damaged" in out.stderr and "step-2 at step 2" in out.stderr
    assert sorted(os.listdir(ckpts)) == ["step-2", "step-4", "step-4.damaged"]
    same_as_straight(out_dir / "full")


def test_weight_push_matches_transformers(toy_dir, tmp_path):
    out = run([sys.executable, SCENARIO, "weight_push", *overrides(toy_dir, tmp_path, run_name="push", **VLLM)])
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["changed"] == res["total"]  # every tensor moved, and vLLM serves the moved weights
    assert res["match"], res


def test_non_finite_loss_skips_then_stops(toy_dir, tmp_path):
    out = run(
        [
            sys.executable,
            SCENARIO,
            "nan_from",
            "1",
            *overrides(toy_dir, tmp_path, run_name="nan", max_steps=4, **{"train.max_bad_steps": 2}),
        ]
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert "2 consecutive steps with a non-finite loss" in res["error"]
    assert res["weights_equal_to_start"]  # skipped steps changed nothing
    m = metrics(tmp_path / "nan")
    assert [r["skipped"] for r in m] == [True, True]


def test_cli_errors_come_before_any_model_loads(toy_dir, tmp_path):
    out = train(["loss.clip_epsilon=0.3"], check=False)
    assert out.returncode == 2 and "did you mean 'loss.clip_eps'" in out.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1=", "answer": "2"}\n{"question": "", "answer": "3"}\n')
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    out = train(
        [
            f"--config={ROOT}/configs/trapo_1k_3k.yaml",
            f"model.path={model}",
            f"data.train_files=[{bad}]",
            f"output_dir={tmp_path}",
        ],
        check=False,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"{bad} line 2: field 'question' is empty" in out.stderr
    out = train(overrides(toy_dir, tmp_path, **{"eval.steps": 1, "eval.select_on": "valdation"}), check=False)
    assert out.returncode == 2 and "eval.select_on: 'valdation' is not a validation benchmark" in out.stderr
    earlier = tmp_path / "earlier"  # a run directory with logs but no checkpoint: never appended to
    earlier.mkdir()
    (earlier / "metrics.jsonl").write_text('{"step": 1}\n')
    unbuilt = tmp_path / "toy-never-built"  # these errors come before the toy's build (minutes on a CPU)
    for resume in ("null", "latest"):
        args = [f"output_dir={tmp_path}", "run_name=earlier", f"resume_from={resume}", f"toy.dir={unbuilt}"]
        out = train(args, check=False)
        assert out.returncode == 2 and f"{earlier} holds an earlier run (metrics.jsonl)" in out.stderr
    assert "stopped before its first checkpoint, so resume_from=latest has nothing to resume" in out.stderr
    assert (earlier / "metrics.jsonl").read_text() == '{"step": 1}\n'
    missing = tmp_path / "nope" / "step-9"
    out = train([f"output_dir={tmp_path}", "run_name=r", f"resume_from={missing}", f"toy.dir={unbuilt}"], check=False)
    assert out.returncode == 2 and f"resume_from: {missing} is not a complete checkpoint" in out.stderr
    assert not unbuilt.exists()
    (tmp_path / "afile").write_text("x")  # an output_dir that is a file: one line, no traceback
    out = train(overrides(toy_dir, tmp_path / "afile", run_name="r"), check=False)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1 and "cannot create or write it" in lines[0], out.stderr


# ----------------------------------------------------------------------------- GPU-launch logic, on CPU


def engine_lines(stderr):
    return [line for line in stderr.splitlines() if "policy and engine agree" in line or "vLLM engines" in line]


def test_rope_override_reaches_both_models_and_health_metric_is_small_at_temperature(toy_dir, tmp_path):
    args = {"model.rope_theta": 40000, "rollout.temperature": 0.7, "max_steps": 2, "run_name": "rope", **VLLM}
    out = train(overrides(toy_dir, tmp_path, **args))
    agree, engines = engine_lines(out.stderr)
    assert "rope_theta 40000," in agree  # read back from the policy's inv_freq and from vLLM's rotary layer
    assert engines.endswith("vLLM engines (tensor parallel 1): rank 0 cpu")
    config = json.loads((tmp_path / "rope" / "checkpoints" / "step-2" / "hf" / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == 40000
    diffs = [r["logprob_diff_rollout_vs_policy"] for r in metrics(tmp_path / "rope")]
    assert all(d < 1e-4 for d in diffs), diffs  # CPU fp32, the same weights, at T = 0.7 on both sides


def test_skipped_weight_push_shows_in_the_health_metric(toy_dir, tmp_path):
    args = overrides(toy_dir, tmp_path, run_name="stale", max_steps=2, **VLLM)
    out = run([sys.executable, SCENARIO, "skip_push", *args])
    assert out.returncode == 0, out.stderr[-3000:]
    first, second = (r["logprob_diff_rollout_vs_policy"] for r in metrics(tmp_path / "stale"))
    assert first < 1e-4  # step 1: the engine still holds the policy's initial weights
    assert second > 1e-3 and second > 100 * first, (first, second)  # step 2: stale weights


def test_a_push_that_misses_a_parameter_fails_naming_it(toy_dir, tmp_path):
    """vLLM only logs a parameter a reload left untouched; after a level-2 sleep it would hold garbage."""
    out = run(
        [
            sys.executable,
            SCENARIO,
            "partial_push",
            *overrides(toy_dir, tmp_path, run_name="partial", max_steps=1, **VLLM),
        ]
    )
    assert out.returncode == 0, out.stderr[-3000:]
    error = json.loads(out.stdout.strip().splitlines()[-1])["error"]
    assert "1 engine parameter(s) received no tensor, e.g. model.layers.1.mlp.gate_up_proj.weight" in error


def test_engine_placement_check(toy_dir):
    out = run([sys.executable, SCENARIO, "placement", os.path.join(toy_dir, "seed-0", "model")])
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["device"] == "cpu" and res["config"]["vocab_size"] > 0
    assert "sits on cpu, expected cuda:0" in res["error"]
    # vLLM reseeds Python's, NumPy's and torch's RNGs while it builds: the trainer's streams are kept
    assert res["rng_kept"] == [True, True, True]
    assert res["max_num_seqs"] == 24  # sized from the config, not vLLM's serving default
    assert res["interface"]  # a trapo.engine.rollout_engine.RolloutEngine


def test_the_policy_recomputes_layers_as_the_checkpointing_choice_says(tmp_path):
    """true and false are obeyed; auto is the memory plan's choice, off on CPU (no GPU memory to plan)."""
    from trapo.commands.toy import _model, _tokenizer
    from trapo.config import Config
    from trapo.engine.memory_plan import checkpointing_line, checkpointing_needed

    _model(_tokenizer([f"{a}+{b}={a + b}" for a in range(10) for b in range(10)]), seed=0).save_pretrained(tmp_path)
    out = run([sys.executable, SCENARIO, "checkpointing", str(tmp_path)])
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    on_cpu = checkpointing_needed(Config(), 1, None, None)  # the default, auto, as the plan decides it here
    assert on_cpu[0] is False
    assert {value: r["on"] for value, r in res.items()} == {"True": True, "False": False, "auto": on_cpu[0]}
    assert res["True"]["said"][0] == "gradient checkpointing: on (model.gradient_checkpointing=true)"
    no_plan = "(auto: no GPU, so no memory plan to fit)"  # each auto setting at the value it had before any plan
    assert res["auto"]["said"][:3] == [
        checkpointing_line(*on_cpu),
        f"ZeRO-3 parameter persistence: off {no_plan}",
        f"LM-head loss chunk: 256 tokens {no_plan}",
    ]


def test_tensor_parallel_rollouts_two_ranks(toy_dir, tmp_path):
    """2 ranks with rollout.tensor_parallel_size=2: one engine shared by both ranks."""
    args = {"rollout.tensor_parallel_size": 2, "max_steps": 2, "run_name": "tp", "eval.steps": 2, **VLLM}
    out = train(overrides(toy_dir, tmp_path, **args), nproc=2)
    assert engine_lines(out.stderr)[1].endswith("vLLM engines (tensor parallel 2): rank 0 cpu, rank 1 cpu")
    m = metrics(tmp_path / "tp")
    assert [r["step"] for r in m] == [1, 2] and all(r["trained_sequences"] > 0 for r in m)
    assert all(r["response_tokens"] > 0 and r["logprob_diff_rollout_vs_policy"] < 1e-3 for r in m)
    assert 0 <= m[1]["eval"]["mean"] <= 1  # validation shards per engine, not per rank


def test_two_nodes_on_localhost_then_resume(toy_dir, tmp_path):
    """Two "nodes" of one process each (DeepSpeed launcher, hostfile, --no_ssh and a node rank per node)."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")

    def launch(node_rank, port, **kv):
        cmd = [launcher, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node_rank)]
        cmd += ["--master_addr", "127.0.0.1", "--master_port", str(port), "trapo_train.py"]
        cmd += overrides(toy_dir, tmp_path, run_name="nodes", save_steps=2, **VLLM, **kv)
        out = subprocess.PIPE  # the user's own script through the real launcher: each rank imports afresh
        return subprocess.Popen(cmd, cwd=ROOT, env=runtime.subprocess_env(), stdout=out, stderr=out, text=True)

    for max_steps in (2, 3):  # the second run resumes from the first's checkpoint
        port = free_port()  # both nodes meet on it
        procs = [launch(node, port, max_steps=max_steps, resume_from="latest") for node in (0, 1)]
        outs = [p.communicate(timeout=600) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
        log = outs[0][1]
        assert "world size 2" in log and "vLLM engines (tensor parallel 1): rank 0 cpu, rank 1 cpu" in log
    assert "resumed from" in log and "step-2 at step 2" in log
    ds = os.listdir(tmp_path / "nodes" / "checkpoints" / "step-2" / "ds")
    assert sum("model_states" in f for f in ds) == 2  # one ZeRO-3 shard per node
    assert [r["step"] for r in metrics(tmp_path / "nodes")] == [1, 2, 3]


def test_dynamic_sampling_two_ranks_refills_keeps_the_batch_size_and_resumes_exactly(toy_dir, tmp_path):
    """2 ranks, rollout.dynamic_sampling: groups with equal rewards leave the update, the
    epoch's next batches refill it to train.rollout_batch_size (the ranks then keep different numbers of
    groups, in two updates each), refills consume the epoch and still give the tracker their pass rates;
    resumed from step 2 the third step equals the straight run's."""
    import torch

    from trapo.data import epoch_batches
    from trapo.engine import checkpoint as ckpt
    from trapo.training import sampling

    ds = {"rollout.dynamic_sampling": "true", "train.update_batch_size": 8, "logging.rollouts_every": 1}
    common = dict(mode="naive_semi", max_steps=3, save_steps=2, **ds, **VLLM)  # vLLM's seeded resume, 2 engines
    train(overrides(toy_dir, tmp_path, run_name="ds", **common), nproc=2)
    m = metrics(tmp_path / "ds")
    assert [r["step"] for r in m] == [1, 2, 3]
    per_epoch, used = 4, 0  # 64 questions in batches of 16
    for r in m:
        d = r["dynamic_sampling"]
        assert d["groups_rolled_out"] == 16 * d["rounds"] and d["extra_rounds"] == d["rounds"] - 1
        assert d["groups_filtered"] + d["groups_kept"] + d["groups_surplus"] == d["groups_rolled_out"]
        assert r["labeled_questions"] + r["unlabeled_questions"] == d["groups_rolled_out"]
        assert r["trained_sequences"] == 8 * d["groups_kept"]  # naive_semi: every kept group is in the loss
        # the dump holds every group rolled out, refills included, in_loss only for the kept ones
        dump = [json.loads(line) for line in (tmp_path / "ds" / "rollouts" / f"step-{r['step']}.jsonl").open()]
        assert len(dump) == d["groups_rolled_out"] and {len(q["responses"]) for q in dump} == {8}
        assert sum(q["in_loss"] for q in dump) == d["groups_kept"]
        used += d["rounds"]
        epoch_end = used == per_epoch
        assert ("selection" in r) == epoch_end
        assert d["groups_kept"] == 16 or epoch_end  # full, unless the epoch ran out (limit 10 > 4 batches)
        assert d["groups_surplus"] == 0 or d["groups_kept"] == 16
        used %= per_epoch
    assert sum(r["dynamic_sampling"]["extra_rounds"] for r in m) > 0, m  # the toy does refill
    # the tracker holds this epoch's pass rates of every question rolled out since its start, refills included
    state = ckpt.read_trainer_state(tmp_path / "ds" / "checkpoints" / "step-3")
    assert state["cursor"] == [1, used]
    current = state["tracker"]["current"]  # NaN: not rolled out yet this epoch
    assert int((~torch.isnan(current)).sum()) == 16 * used
    # step 3 rebuilt from the pass rates (a pass rate strictly between 0 and 1 <=> unequal rewards): the
    # informative groups are those the metrics count, and the ranks kept different numbers of them
    order = epoch_batches(64, 16, 2, seed=0, epoch=1)
    flags = [[[0 < float(current[q]) < 1 for q in order[i][r::2]] for r in range(2)] for i in range(used)]
    keys = [k for i, f in enumerate(flags) for k in sampling.round_keys(i, f)]
    d = m[2]["dynamic_sampling"]
    assert len(keys) == d["groups_kept"] + d["groups_surplus"]
    per_rank = [sum(k[1] % 2 == r for k in sampling.cut(keys, 16)) for r in range(2)]
    assert sum(per_rank) == d["groups_kept"], per_rank
    # each rank trained exactly the groups the global cut gave it (the dump's in_loss, by the rank that rolled
    # each question out). How many that is depends on the toy's numerics: 7 and 9 on the AVX-512 machines, 8
    # and 8 on AVX2 ones; unequal splits are unit-tested (test_sampling.py, update plan and take)
    kept = {
        q["question"] for q in map(json.loads, (tmp_path / "ds" / "rollouts" / "step-3.jsonl").open()) if q["in_loss"]
    }
    assert [sum(q in kept for i in range(used) for q in order[i][r::2]) for r in range(2)] == per_rank

    train(
        overrides(toy_dir, tmp_path, run_name="re", resume_from=tmp_path / "ds" / "checkpoints" / "step-2", **common),
        nproc=2,
    )
    (again,) = metrics(tmp_path / "re")
    for key in ("loss", "pg_loss", "dynamic_sampling", "response_tokens", "pass_rate_labeled", "selection"):
        assert again.get(key) == m[2].get(key), key
