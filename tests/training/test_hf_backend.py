"""rollout.backend=hf end to end on the toy, in processes where vLLM cannot be imported (tests/scripts/without_vllm.py):
it trains, its rollouts agree with the policy, a resume from step 6 equals 12 straight steps;
backend vllm there stops with one line naming the key; auto there runs hf, and a resume keeps it."""

import json
import os
import sys

import pytest
import yaml
from toyrun import ROOT, metrics, overrides, run, stopped_at, train

WITHOUT_VLLM = os.path.join(ROOT, "tests", "scripts", "without_vllm.py")
HF = {"rollout.backend": "hf", "mode": "trapo", "save_steps": 6}
SAME = ("loss", "pg_loss", "reward_labeled", "pass_rate_labeled", "pass_rate_unlabeled", "response_tokens", "selection")


def without_vllm(args):
    out = run([sys.executable, WITHOUT_VLLM, *args])
    assert out.returncode == 0, out.stderr[-4000:]
    return out


@pytest.mark.toy_run
def test_hf_backend_trains_without_vllm_and_resumes_exactly(toy_dir, tmp_path):
    without_vllm(overrides(toy_dir, tmp_path, run_name="straight", max_steps=12, **HF))
    straight = metrics(tmp_path / "straight")
    assert [r["step"] for r in straight] == list(range(1, 13))
    assert all(r["logprob_diff_rollout_vs_policy"] < 1e-4 for r in straight), [
        r["logprob_diff_rollout_vs_policy"] for r in straight
    ]
    assert all(r["pushed_gb"] == 0 for r in straight)  # the engine is the policy: nothing to push
    assert any(r.get("selection", {}).get("tcs_selected") is not None for r in straight)  # past the warm-up

    stopped_at(tmp_path / "straight", tmp_path / "resumed", 6)
    out = without_vllm(overrides(toy_dir, tmp_path, run_name="resumed", max_steps=12, resume_from="latest", **HF))
    assert "step-6 at step 6" in out.stderr
    resumed = metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == list(range(1, 13))
    for a, b in zip(straight, resumed):  # CPU fp32: the same rollouts, rewards, pass rates and losses
        for key in SAME:
            assert a.get(key) == b.get(key), (a["step"], key)


@pytest.mark.toy_run
def test_auto_runs_hf_without_vllm_and_a_resume_where_vllm_is_keeps_the_engine_it_started_with(toy_dir, tmp_path):
    """rollout.backend auto (the default) where vLLM cannot be imported: the hf backend, said once and written into
    config.yaml; resumed where vLLM is installed, the run keeps hf (auto alone would pick vLLM there)."""
    from trapo.engine.rollout import installed

    auto = {"rollout.backend": "auto"}  # the default; toyrun's runs name hf
    first = without_vllm(overrides(toy_dir, tmp_path, run_name="auto", max_steps=2, save_steps=2, **auto))
    assert first.stderr.count("rollout.backend auto: hf (vLLM is not installed") == 1, first.stderr[-3000:]
    config = tmp_path / "auto" / "config.yaml"
    assert yaml.safe_load(config.read_text())["rollout"]["backend"] == "hf"  # what ran, not "auto"
    if not installed("vllm"):
        pytest.skip("the resume half needs vLLM installed (make setup installs it)")
    out = train(overrides(toy_dir, tmp_path, run_name="auto", max_steps=3, save_steps=2, resume_from="latest", **auto))
    assert "rollout.backend auto: hf (as this run started" in out.stderr and "step-2 at step 2" in out.stderr
    assert yaml.safe_load(config.read_text())["rollout"]["backend"] == "hf"
    starts = [json.loads(line) for line in (tmp_path / "auto" / "starts.jsonl").read_text().splitlines()]
    assert set(starts[-1]["changes"]) == {"max_steps", "resume_from"}  # the engine did not change
    assert [r["step"] for r in metrics(tmp_path / "auto")] == [1, 2, 3]


@pytest.mark.toy_run
def test_backend_vllm_without_vllm_is_one_line_naming_the_fix(toy_dir, tmp_path):
    args = overrides(toy_dir, tmp_path, run_name="novllm", max_steps=1, **{"rollout.backend": "vllm"})
    out = run([sys.executable, WITHOUT_VLLM, *args])
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert len(lines) == 1 and "rollout.backend" in lines[0] and "rollout.backend=hf" in lines[0], out.stderr
    assert not (tmp_path / "novllm").exists()  # stopped before any work


@pytest.mark.toy_run
def test_eval_backend_hf_greedy_writes_what_vllm_writes(toy_dir, tmp_path):
    """Greedy decoding in fp32: both backends take the same argmax at every step, so they write the same texts."""
    model = os.path.join(toy_dir, "seed-0", "model")
    test = os.path.join(toy_dir, "seed-0", "test.jsonl")
    common = [
        "-m",
        "trapo",
        "eval",
        "--model",
        model,
        "--benchmarks",
        test,
        "--n",
        "1",
        "--temperature",
        "0",
        "--template",
        "plain",
        "--max-tokens",
        "12",
        "--max-prompt-tokens",
        "16",
    ]
    texts = {}
    for backend in ("hf", "vllm"):
        out = run([sys.executable, *common, "--backend", backend, "--out", str(tmp_path / backend)])
        assert out.returncode == 0, out.stderr[-3000:]
        rows = (tmp_path / backend / "samples.jsonl").read_text().splitlines()
        texts[backend] = [json.loads(r)["responses"][0]["text"] for r in rows]
    assert len(texts["hf"]) == 16 and texts["hf"] == texts["vllm"]
