"""The optimizer state after a resume through DeepSpeed's universal form (trapo/engine/reshard.py `place_state`):
each state tensor where torch's own `Optimizer.load_state_dict` puts it, each parameter with its own step."""

import json
import os

import pytest
import torch
from toyrun import Ranks

from trapo import runtime
from trapo.engine.reshard import place_state

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "resume_moved.py")


def test_a_state_loaded_elsewhere_moves_to_its_parameters_device():
    # "meta" stands in for the GPU: the universal loader leaves `step` on the CPU beside the parameters.
    p = torch.nn.Parameter(torch.zeros(4, device="meta"))
    fused = torch.optim.AdamW([p], fused=True)
    fused.state[p] = {"step": torch.tensor(7.0, dtype=torch.float64), "exp_avg": torch.ones(4)}
    place_state(fused)
    assert {k: (v.device.type, v.dtype) for k, v in fused.state[p].items()} == {
        "step": ("meta", torch.float32),  # where the fused kernel reads it
        "exp_avg": ("meta", torch.float32),
    }
    plain = torch.optim.AdamW([p], fused=False)
    plain.state[p] = {"step": torch.tensor(7.0), "exp_avg": torch.ones(4)}
    place_state(plain)
    assert plain.state[p]["step"].device.type == "cpu"  # unfused AdamW keeps its step on the CPU on purpose
    assert plain.state[p]["exp_avg"].device.type == "meta"


def test_a_state_already_in_place_is_left_as_it_is():
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(2)]
    optimizer = torch.optim.AdamW(params, fused=True)
    for p in params:
        p.grad = torch.ones(3)
    optimizer.step()
    before = {(i, k): v for i, p in enumerate(params) for k, v in optimizer.state[p].items()}
    place_state(optimizer)
    after = {(i, k): v for i, p in enumerate(params) for k, v in optimizer.state[p].items()}
    assert before.keys() == after.keys() and all(after[key] is before[key] for key in before)


def test_a_shared_step_becomes_one_per_parameter_and_updates_as_torch_loads_it():
    def optimizer(seed):
        torch.manual_seed(seed)
        params = [torch.nn.Parameter(torch.randn(5)) for _ in range(3)]
        return params, torch.optim.AdamW(params, lr=0.1)

    params, saved = optimizer(0)
    for step in range(2):
        for p in params:
            p.grad = torch.full_like(p, step + 1.0)
        saved.step()
    state = saved.state_dict()

    loaded_params, loaded = optimizer(1)
    loaded.load_state_dict(state)  # torch's own placement: the reference
    assigned_params, assigned = optimizer(1)
    shared = state["state"][0]["step"].clone()  # (the state dict's own is the one `loaded` now holds)
    for i, p in enumerate(assigned_params):  # as ZeRO-3's universal loader assigns it: one step for all
        assigned.state[p] = {"step": shared, **{k: v.clone() for k, v in state["state"][i].items() if k != "step"}}
    place_state(assigned)
    for opt, ps in ((loaded, loaded_params), (assigned, assigned_params)):
        for p in ps:
            p.grad = torch.full_like(p, 3.0)
        opt.step()
    assert [float(assigned.state[p]["step"]) for p in assigned_params] == [3.0, 3.0, 3.0]  # not 2 + 3
    for a, b in zip(assigned_params, loaded_params):
        assert torch.equal(a, b)


@pytest.mark.toy_run
def test_a_checkpoint_saved_on_two_ranks_resumes_on_one_with_its_optimizer_state_in_place(tmp_path):
    """A ZeRO-3 engine with three sub-groups per rank, saved on 2 ranks (gloo) after 2 steps and resumed on 1
    through trapo.engine.checkpoint.restore: every state tensor sits on its partition's device, each sub-group
    has its own step, and the next update counts it once."""
    path = str(tmp_path / "step-2")
    # each process forked from the worker's fork server, as a toy run's ranks (tests/toyrun.py)
    saved = Ranks(["save", path], nproc=2, script=SCRIPT).wait(timeout=240)
    assert saved.returncode == 0, f"saving:\n{saved.stderr[-3000:]}"
    env = {k: v for k, v in runtime.subprocess_env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = Ranks(["resume", path, "2"], env=env, script=SCRIPT).wait(timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    loaded, after = out["loaded"], out["after_step"]
    assert len(loaded["steps"]) == 3  # the sub-groups of the one rank, each an entry of torch's optimizer state
    assert loaded["misplaced"] == [] and loaded["distinct_steps"] == 3 and loaded["steps"] == [2.0, 2.0, 2.0]
    assert after["misplaced"] == [] and after["steps"] == [3.0, 3.0, 3.0]
    assert not list(tmp_path.glob(".*"))  # the universal scratch is gone
