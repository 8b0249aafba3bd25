"""The fault switch (trapo/faults.py): off unless named, one name at a time, unknown names refused; the faults'
effects themselves are driven end to end by tests/training/test_health.py and tests/engine/test_grader_deaths.py."""

import os

import pytest
import torch

from trapo import faults


def test_a_fault_is_hit_only_when_its_name_is_switched_on(monkeypatch):
    monkeypatch.delenv(faults.VARIABLE, raising=False)
    assert not any(faults.hit(name) for name in faults.FAULTS)
    monkeypatch.setenv(*next(iter(faults.env("push_noise").items())))
    assert faults.hit("push_noise") and not faults.hit("grader_crash")
    with pytest.raises(ValueError, match="unknown fault 'push_nosie'"):
        faults.hit("push_nosie")
    with pytest.raises(ValueError, match="unknown fault"):
        faults.env("grader-crash")


def test_push_noise_corrupts_float_tensors_alike_on_every_push_and_leaves_the_rest():
    weights = [("w", torch.linspace(-1, 1, 64)), ("ids", torch.arange(4)), ("scale", torch.tensor([2.0]))]
    first, second = list(faults.noisy(weights)), list(faults.noisy(weights))
    assert [n for n, _ in first] == ["w", "ids", "scale"]
    assert torch.equal(first[0][1], second[0][1])  # seeded: a run with the fault repeats itself
    assert (first[0][1] - weights[0][1]).std() > 4 * weights[0][1].std()
    assert torch.equal(first[1][1], weights[1][1]) and torch.equal(first[2][1], weights[2][1])


def test_a_one_shot_fault_is_spent_in_this_process_and_the_children_it_starts(monkeypatch):
    monkeypatch.setenv(*next(iter(faults.env("grader_first_start").items())))
    assert faults.hit("grader_first_start")
    faults.spend("grader_first_start")
    assert not faults.hit("grader_first_start") and faults.VARIABLE not in os.environ
    faults.spend("grader_first_start")  # spent already: nothing to do
