"""What the memory plan chooses for the auto settings (memory_plan.choose), planned on CPU for the paper's 1.5B
config on one 141 GiB and one 80 GiB card: the LM head's chunk, ZeRO-3 parameter persistence and the hf
backend's rows, each the largest the plan fits, explicit settings obeyed, the old defaults where no plan decides."""

import json
import os
import re
import subprocess
import sys

import pytest

from trapo.config import load_config
from trapo.engine.memory_plan import CHUNK_FLOOR, SPARE, GiB, choose, memory_plan
from trapo.engine.model_shapes import model_arch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "trapo_1k_3k_r1distill_1p5b.yaml")


def planned(world, gib, *overrides):
    cfg = load_config(CONFIG, list(overrides))
    ds = json.loads(open(os.path.join(ROOT, cfg.train.deepspeed_config)).read())
    arch = model_arch(cfg.model.path)
    return choose(cfg, world, gib * GiB, arch, ds), lambda *more: memory_plan(
        load_config(CONFIG, [*overrides, *more]), world, gib * GiB, arch, ds
    )


@pytest.mark.parametrize("gib", [141, 80])
def test_one_gpu_keeps_the_model_gathered_and_takes_an_lm_head_chunk_that_fits_beside_the_update(gib):
    choices, plan = planned(1, gib)
    chunk, persistent = choices.loss_chunk[0], choices.persistence[0]
    assert persistent is True and "one GPU" in choices.persistence[1]
    assert chunk >= CHUNK_FLOOR
    at = plan(f"train.loss_chunk_tokens={chunk}", "train.param_persistence=true")
    least = plan("train.loss_chunk_tokens=256", "train.param_persistence=true").peak("update")
    assert at.fits and (at.peak("update") == least or chunk == CHUNK_FLOOR)  # beside the peak, or the floor
    if chunk < at.tokens:  # the next candidate would raise the update's peak
        bigger = plan(f"train.loss_chunk_tokens={min(2 * chunk, at.tokens)}", "train.param_persistence=true")
        assert bigger.peak("update") > least
    assert plan().choices == choices  # the plan counts what it chose
    assert at.phases["update"] == plan().phases["update"]
    # a card where the whole model kept gathered does not fit beside the rest: persistence off, said why
    small = planned(1, 24)[0].persistence
    assert small[0] is False and "would need" in small[1]


@pytest.mark.parametrize("gib", [141, 80])
def test_the_hf_backend_generates_the_most_rows_whose_rollout_fits_with_a_tenth_spare(gib):
    choices, plan = planned(1, gib, "rollout.backend=hf")
    rows = choices.hf_rows[0]
    at = plan("rollout.backend=hf", f"rollout.hf_max_batch={rows}")
    assert at.peak("rollout") <= (1 - SPARE) * at.gpu_bytes
    assert rows == at.kv["sequences_needed"] or (
        plan("rollout.backend=hf", f"rollout.hf_max_batch={rows + 1}").peak("rollout") > (1 - SPARE) * at.gpu_bytes
    )
    assert rows > 1 and choices.hf_rows[1].startswith(f"auto: {rows} of the rank's")


def test_explicit_settings_are_obeyed_several_gpus_partition_and_no_gpu_keeps_the_old_defaults():
    choices, _ = planned(1, 141, "train.loss_chunk_tokens=512", "train.param_persistence=false")
    assert choices.loss_chunk == (512, "train.loss_chunk_tokens=512")
    assert choices.persistence == (False, "train.param_persistence=false")
    choices, _ = planned(8, 80)
    assert choices.persistence == (False, "auto: 8 GPUs train, and ZeRO-3 partitions the parameters over them")
    assert choices.hf_rows is None  # vLLM sizes its own batches
    cfg = load_config(CONFIG, ["rollout.backend=hf"])
    cpu = choose(cfg, 1, None, None)
    no_plan = "auto: no GPU, so no memory plan to fit"
    assert (cpu.persistence, cpu.loss_chunk, cpu.hf_rows) == ((False, no_plan), (256, no_plan), (256, no_plan))
    run = cpu.apply(cfg)
    assert (run.train.loss_chunk_tokens, run.train.param_persistence, run.rollout.hf_max_batch) == (256, False, 256)
    assert run.model.gradient_checkpointing is True  # the config's own true
    unread = choose(cfg, 1, 80 * GiB, None)  # a GPU, and a model whose shapes the plan cannot read
    why = "auto: the memory plan cannot read the model's architecture"
    assert (unread.persistence, unread.loss_chunk, unread.hf_rows) == ((False, why), (256, why), (256, why))


def test_doctor_plan_names_each_choice():
    args = ["--plan", "--config", CONFIG, "--gpus", "1", "--gpu-memory-gb", "141"]
    out = subprocess.run([sys.executable, "-m", "trapo", "doctor", *args], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    chunk = re.search(r"^LM-head loss chunk: (\d+) tokens \(auto: ", out.stdout, flags=re.M)
    assert chunk and int(chunk[1]) >= 2048
    assert re.search(r"^ZeRO-3 parameter persistence: on \(auto: one GPU", out.stdout, flags=re.M)
