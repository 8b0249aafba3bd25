"""Toy runs that several tests compare with, run once per session (per xdist worker: the tests that share one
are in one xdist group, so one worker runs them all and the run happens once)."""

import pytest
from toyrun import STRAIGHT, VLLM_RUN, overrides, train


@pytest.fixture(scope="session")
def straight_run(toy_dir, tmp_path_factory):
    """The run directory of an uninterrupted `STRAIGHT` run: killed, stopped or disk-full runs that resume must
    equal it. (Saving is read-only for the run's state, so runs with another save cadence compare with it too.)"""
    out = tmp_path_factory.mktemp("straight")
    train(overrides(toy_dir, out, run_name="straight", **STRAIGHT))
    return out / "straight"


@pytest.fixture(scope="session")
def vllm_run(toy_dir, tmp_path_factory):
    """The run directory of an uninterrupted colocated `VLLM_RUN` on one rank: what a checkpoint moved between
    world sizes resumes to, and what vLLM on a separate rollout rank must write at staleness 0. Its tests are in
    the xdist group "vllm_run"."""
    out = tmp_path_factory.mktemp("vllm")
    train(overrides(toy_dir, out, run_name="one", **VLLM_RUN))
    return out / "one"
