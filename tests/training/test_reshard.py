"""A checkpoint saved on N ranks resumes on M (trapo/engine/reshard.py): 4 steps on 2 ranks resumed on 1 to 8
steps equals 8 straight steps on 1 rank, and 1 rank resumed on 2 equals 8 straight steps on 2; the resume is
at the toy's epoch boundary (4 steps per epoch), where the selection ran. Loss to float rounding (the update's
sums run in another order), rewards and pass rates exactly."""

import json

import pytest
from toyrun import VLLM_RUN, metrics, overrides, stopped_at, train

# vLLM: its rollouts do not depend on how many ranks share the questions; the hf backend's batch shape
# changes its float rounding, which can flip a near-tie token after the resume onto another rank count.
ARGS = {k: v for k, v in VLLM_RUN.items() if k != "max_steps"}
EXACT = ("reward_labeled", "pass_rate_labeled", "pass_rate_unlabeled", "response_tokens", "selection")


def moved(toy_dir, tmp_path, source, name, nproc, damage=False):
    """The run directory `source` up to its step-4 checkpoint, resumed to step 8 on `nproc` ranks. With `damage`
    its step-8 checkpoint stays, with a rank's optimizer file truncated: resume_from=latest sets it aside."""
    run_dir = stopped_at(source, tmp_path / name, 8 if damage else 4)
    if damage:
        shard = sorted((run_dir / "checkpoints" / "step-8" / "ds").glob("*optim_states.pt"))[-1]
        shard.write_bytes(shard.read_bytes()[:100])
    out = train(overrides(toy_dir, tmp_path, run_name=name, max_steps=8, resume_from="latest", **ARGS), nproc=nproc)
    return out, metrics(tmp_path / name)


def same(a, b):
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 9))
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-9), x["step"]
        for key in EXACT:
            assert x.get(key) == y.get(key), (x["step"], key)


@pytest.mark.toy_run
@pytest.mark.xdist_group("vllm_run")
def test_a_checkpoint_moves_between_one_and_two_ranks_and_resumes_exactly(toy_dir, tmp_path, vllm_run):
    train(overrides(toy_dir, tmp_path, run_name="two", max_steps=8, **ARGS), nproc=2)
    one, two = metrics(vllm_run), metrics(tmp_path / "two")
    same(one, two)  # the run itself does not depend on the world size

    down, resumed_down = moved(toy_dir, tmp_path, tmp_path / "two", "down", nproc=1, damage=True)
    assert "step-8 is damaged" in down.stderr and "set aside as step-8.damaged" in down.stderr
    assert "checkpoints/step-4 was saved with 2 ranks; resuming with 1" in down.stderr
    same(resumed_down, one)
    up, resumed_up = moved(toy_dir, tmp_path, vllm_run, "up", nproc=2)
    assert "checkpoints/step-4 was saved with 1 ranks; resuming with 2" in up.stderr
    same(resumed_up, two)
    start = json.loads((tmp_path / "down" / "starts.jsonl").read_text().splitlines()[-1])
    assert (start["step"], start["world"], start["moved_from_world"]) == (4, 1, 2)
    assert not list((tmp_path / "down" / "checkpoints").glob(".*"))  # the universal scratch is gone
