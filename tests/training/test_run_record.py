"""One run per run directory, and a resume that keeps the run's record (trapo/training/run_record.py): the lock
is the kernel's (a killed holder leaves none behind), a held directory is one line naming its holder, a resume
refuses changed settings that would alter the run unless named, and every start is recorded."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml
from toyrun import ROOT, Ranks, metrics, overrides, train

from trapo import runtime
from trapo.config import Config, ConfigError, dump_config, load_config, to_dict
from trapo.training import run_record

HOLD = (
    "import sys, time; from trapo.training.run_record import claim; claim(sys.argv[1]); print('held', flush=True); "
    "time.sleep(600)"
)


def holding(run_dir):
    """A process that holds `run_dir`'s lock until killed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)],
        cwd=ROOT,
        env=runtime.subprocess_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_held_directory_is_refused_naming_its_holder_and_a_killed_holder_leaves_no_lock(tmp_path):
    run_dir = tmp_path / "run"
    proc = holding(run_dir)
    try:
        with pytest.raises(ConfigError, match=rf"is in use by pid {proc.pid} on host \S+ since 20\d\d-"):
            run_record.claim(run_dir)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    run_record.claim(run_dir)  # the kernel dropped the dead holder's lock
    run_record.claim(run_dir)  # held by this process already: nothing to do
    assert json.loads((run_dir / ".lock").read_text())["pid"] == os.getpid()
    run_record.release(run_dir)


def test_a_run_directory_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="a file is in the way"):
        run_record.claim(tmp_path / "file")
    with pytest.raises(ConfigError, match="cannot create or write it .*choose a writable output_dir"):
        run_record.claim(tmp_path / "file" / "run")


def first_start(tmp_path, cfg):
    run_record.record_start(tmp_path, dump_config(cfg), {"step": 0, "resumed_from": None, "changes": {}})


def test_a_resume_refuses_changes_that_alter_the_run_and_lists_each(tmp_path):
    cfg = Config()
    first_start(tmp_path, cfg)
    changed = dataclasses.replace(cfg, seed=3, rollout=dataclasses.replace(cfg.rollout, n=16))
    with pytest.raises(ConfigError) as err:
        run_record.resume_changes(tmp_path, to_dict(changed), allowed=[])
    line = str(err.value)
    assert "rollout.n: 8 -> 16" in line and "seed: 0 -> 3" in line and "resume_changes=[seed,rollout.n]" in line
    assert run_record.resume_changes(tmp_path, to_dict(changed), allowed=["seed", "rollout.n"]) == {
        "seed": [0, 3],
        "rollout.n": [8, 16],
    }
    safe = dataclasses.replace(cfg, max_steps=50, eval=dataclasses.replace(cfg.eval, steps=5))
    assert run_record.resume_changes(tmp_path, to_dict(safe), allowed=[]) == {
        "max_steps": [None, 50],
        "eval.steps": [0, 5],
    }


def test_a_structural_change_is_refused_even_when_named_in_one_line(tmp_path):
    """The adapters' rank and layers, and the dtype, shape the checkpoint's state: naming them in
    resume_changes cannot make it load, so the resume stops here, before any model loads."""
    cfg = Config()
    cfg.model.lora.rank, cfg.model.dtype = 8, "float32"
    first_start(tmp_path, cfg)
    checkpoint = tmp_path / "checkpoints" / "step-4"

    def resumed(**model):
        lora = {k: v for k, v in model.items() if k in ("rank", "alpha", "target_modules")}
        rest = {k: v for k, v in model.items() if k not in lora}
        new_lora = dataclasses.replace(cfg.model.lora, **lora)
        return to_dict(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora=new_lora, **rest)))

    for change, key in [
        ({"rank": 16}, "model.lora.rank: 8 -> 16"),
        ({"rank": 0}, "model.lora.rank: 8 -> 0"),
        ({"target_modules": ["q_proj", "v_proj"]}, "model.lora.target_modules: "),
        ({"dtype": "bfloat16"}, "model.dtype: 'float32' -> 'bfloat16'"),
    ]:
        named = ["model.lora.rank", "model.lora.target_modules", "model.dtype"]
        with pytest.raises(ConfigError) as err:
            run_record.resume_changes(tmp_path, resumed(**change), allowed=named, checkpoint=checkpoint)
        line = str(err.value)
        assert "\n" not in line and key in line and "even named in resume_changes" in line, line
        assert f"model.path={checkpoint / 'hf'}" in line and "resume_changes=[" not in line, line
    # what loads may change when named: the scale, the same layers listed in another order, the same dtype
    order = list(reversed(cfg.model.lora.target_modules))
    changes = run_record.resume_changes(
        tmp_path, resumed(alpha=32.0, target_modules=order), allowed=["model.lora.alpha", "model.lora.target_modules"]
    )
    assert changes["model.lora.alpha"] == [16.0, 32.0] and "model.lora.target_modules" in changes
    with pytest.raises(ConfigError, match=r"resume_changes=\[model.lora.alpha\]"):  # unnamed: the usual refusal
        run_record.resume_changes(tmp_path, resumed(alpha=32.0), allowed=[])
    full = dataclasses.replace(cfg.model.lora, rank=0)  # full fine-tuning: the target list means nothing
    first_start(tmp_path, dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora=full)))
    assert "model.lora.target_modules" in run_record.resume_changes(
        tmp_path, resumed(rank=0, target_modules=["q_proj"]), allowed=["model.lora.target_modules"]
    )
    auto = runtime.dtype_name("auto")  # what "auto" resolves to here: the same dtype, named two ways
    cfg.model.dtype = auto
    first_start(tmp_path, cfg)
    assert run_record.resume_changes(tmp_path, resumed(dtype="auto"), allowed=["model.dtype"]) == {
        "model.dtype": [auto, "auto"]
    }


def test_the_first_config_stays_and_every_start_is_recorded(tmp_path):
    first_start(tmp_path, Config())
    later = Config(max_steps=9)
    run_record.record_start(tmp_path, dump_config(later), {"step": 4, "resumed_from": "x", "changes": {"a": [1, 2]}})
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["max_steps"] is None
    starts = [json.loads(line) for line in (tmp_path / "starts.jsonl").read_text().splitlines()]
    assert [s["step"] for s in starts] == [0, 4] and starts[1]["changes"] == {"a": [1, 2]}
    assert {"time", "host", "pid"} <= set(starts[0])


def toy_config(tmp_path, *overrides):
    return load_config(os.path.join(ROOT, "configs", "toy.yaml"), [f"output_dir={tmp_path}", *overrides])


def test_backend_auto_is_vllm_where_it_is_installed_else_hf_said_once_and_recorded(tmp_path, monkeypatch):
    from trapo.engine.rollout import installed

    lines = []
    fresh = toy_config(tmp_path)
    assert fresh.rollout.backend == "auto"  # the default: a machine without vLLM runs too
    chosen = run_record.resolve_backend(fresh, say=lines.append)
    expected = "vllm" if installed("vllm") else "hf"
    assert (
        chosen.rollout.backend == expected
        and len(lines) == 1
        and lines[0].startswith(f"rollout.backend auto: {expected}")
    )
    assert yaml.safe_load(dump_config(chosen))["rollout"]["backend"] == expected  # config.yaml: what ran
    monkeypatch.setitem(sys.modules, "vllm", None)  # as on a machine without vLLM: `import vllm` fails
    lines.clear()
    assert run_record.resolve_backend(fresh, say=lines.append).rollout.backend == "hf"
    assert "vLLM is not installed" in lines[0]
    named = toy_config(tmp_path)
    named.rollout.backend = "vllm"
    assert run_record.resolve_backend(named, say=lines.append) is named and len(lines) == 1  # named: no choice
    tp = toy_config(tmp_path, "rollout.tensor_parallel_size=2")
    with pytest.raises(ConfigError, match="rollout.backend auto \\(hf\\): key 'rollout.tensor_parallel_size'"):
        run_record.resolve_backend(tp, say=lines.append)


@pytest.mark.parametrize("vllm_here", [True, False], ids=["vllm-here", "no-vllm-here"])
def test_backend_auto_with_separate_placement_chooses_as_colocated_and_says_why(tmp_path, monkeypatch, vllm_here):
    """Separate rollout ranks run either engine: auto chooses vLLM where it is installed, else hf."""
    if not vllm_here:
        monkeypatch.setitem(sys.modules, "vllm", None)
    lines = []
    separate = toy_config(tmp_path, "rollout.placement=separate", "rollout.ranks=1")
    assert separate.rollout.backend == "auto"  # the default passes validation with separate
    chosen = run_record.resolve_backend(separate, say=lines.append)
    why = "vLLM is installed" if vllm_here else "vLLM is not installed"
    assert chosen.rollout.backend == ("vllm" if vllm_here else "hf") and len(lines) == 1 and why in lines[0]
    assert toy_config(tmp_path, "rollout.placement=separate", "rollout.backend=vllm").rollout.backend == "vllm"
    with pytest.raises(ConfigError, match="rollout.tensor_parallel_size.*one engine per rollout rank"):
        toy_config(tmp_path, "rollout.placement=separate", "rollout.backend=vllm", "rollout.tensor_parallel_size=2")


@pytest.mark.parametrize("vllm_here", [True, False], ids=["vllm-here", "no-vllm-here"])
def test_a_resume_keeps_the_backend_it_started_with_unless_resume_changes_names_it(tmp_path, monkeypatch, vllm_here):
    """A run that started with one engine resumes with it on a machine where auto would pick the other."""
    if not vllm_here:
        monkeypatch.setitem(sys.modules, "vllm", None)
    started_with = "hf" if vllm_here else "vllm"  # the other one than auto picks here
    first = toy_config(tmp_path)
    first.rollout.backend = started_with
    run_dir = first.run_dir
    run_dir.mkdir(parents=True)
    run_record.record_start(run_dir, dump_config(first), {"step": 0, "resumed_from": None})
    lines = []
    resume = toy_config(tmp_path, "resume_from=latest")
    kept = run_record.resolve_backend(resume, say=lines.append)
    assert kept.rollout.backend == started_with and "as this run started" in lines[0]
    assert "rollout.backend" not in run_record.resume_changes(run_dir, to_dict(kept), allowed=[])  # it resumes
    again = toy_config(tmp_path, "resume_from=latest", "resume_changes=[rollout.backend]")
    switched = run_record.resolve_backend(again, say=lines.append).rollout.backend
    assert switched == ("vllm" if vllm_here else "hf")
    assert run_record.resolve_backend(toy_config(tmp_path), say=lines.append).rollout.backend == switched


def test_run_name_is_a_plain_name_and_resume_changes_names_real_keys():
    toy = os.path.join(ROOT, "configs", "toy.yaml")
    for bad in ("..", ".", "a/b", " "):
        with pytest.raises(ConfigError, match="run_name"):
            load_config(toy, [f"run_name={bad}"])
    with pytest.raises(ConfigError, match="'rollout.nn' is not a setting"):
        load_config(toy, ["resume_changes=[rollout.nn]"])
    assert load_config(toy, ["resume_changes=[rollout.n, train.lr]"]).resume_changes == ["rollout.n", "train.lr"]


@pytest.mark.toy_run
def test_a_second_run_into_a_live_runs_directory_is_one_line_and_the_first_is_untouched(toy_dir, tmp_path):
    args = overrides(toy_dir, tmp_path, run_name="busy", max_steps=12)
    first = Ranks(args)
    lock = tmp_path / "busy" / ".lock"
    deadline = time.time() + 120
    while not (lock.is_file() and lock.read_text()) and time.time() < deadline:
        time.sleep(0.2)
    second = train(args, check=False)
    lines = [line for line in second.stderr.splitlines() if line.strip()]
    assert second.returncode == 2 and len(lines) == 1 and "Traceback" not in second.stderr, second.stderr
    assert f"is in use by pid {first.procs[0].pid}" in lines[0]
    out = first.wait(timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [r["step"] for r in metrics(tmp_path / "busy")] == list(range(1, 13))


@pytest.mark.toy_run
@pytest.mark.xdist_group("straight_run")
def test_a_resume_with_a_changed_setting_stops_before_loading_and_keeps_the_first_config(
    toy_dir, tmp_path, straight_run
):
    shutil.copytree(straight_run, tmp_path / "straight")
    config = (tmp_path / "straight" / "config.yaml").read_text()
    args = overrides(toy_dir, tmp_path, run_name="straight", mode="trapo", resume_from="latest", save_steps=2)
    changed = train([*args, "max_steps=6", "rollout.n=4"], check=False)
    lines = [line for line in changed.stderr.splitlines() if line.strip()]
    assert changed.returncode == 2 and "Traceback" not in changed.stderr, changed.stderr[-3000:]
    assert "rollout.n: 8 -> 4" in lines[-1] and "resume_changes=[rollout.n]" in lines[-1]
    assert (tmp_path / "straight" / "config.yaml").read_text() == config

    train([*args, "max_steps=6"])  # steps and saving may change
    assert (tmp_path / "straight" / "config.yaml").read_text() == config
    starts = [json.loads(line) for line in (tmp_path / "straight" / "starts.jsonl").read_text().splitlines()]
    assert [s["step"] for s in starts] == [0, 4] and starts[0]["changes"] == {}
    assert starts[1]["changes"]["max_steps"] == [4, 6] and set(starts[1]["changes"]) <= {
        "max_steps",
        "resume_from",
        "output_dir",
    }  # the copy moved the run directory: output_dir is recorded too
    assert [r["step"] for r in metrics(tmp_path / "straight")] == list(range(1, 7))


@pytest.mark.toy_run
@pytest.mark.xdist_group("straight_run")
def test_a_resume_naming_a_structural_change_stops_in_one_line_before_loading(toy_dir, tmp_path, straight_run):
    """The issue's case on the toy: a full fine-tuning run resumed with adapters (model.lora.rank 0 -> 8), the
    change named in resume_changes: refused before the policy loads, the checkpoint's hf/ proposed instead."""
    shutil.copytree(straight_run, tmp_path / "straight")
    args = overrides(toy_dir, tmp_path, run_name="straight", mode="trapo", resume_from="latest", max_steps=6)
    out = train([*args, "model.lora.rank=8", "resume_changes=[model.lora.rank]"], check=False)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "model.lora.rank: 0 -> 8" in lines[-1] and "even named in resume_changes" in lines[-1], lines[-1]
    assert "/checkpoints/step-" in lines[-1] and "/hf" in lines[-1]
    assert "trainable parameters" not in out.stderr  # the adapters were never attached: no model loaded
    starts = (tmp_path / "straight" / "starts.jsonl").read_text().splitlines()
    assert len(starts) == 1  # this start was not recorded: nothing written
