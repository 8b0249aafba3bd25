"""Studies as data (trapo/commands/reproduce/study.py): every shipped study file loads and prints one launch per
condition and seed, conditions shared between studies share their runs, a bad study is one line, and a tiny
study runs end to end through a kill: finished runs are kept, the killed one resumes from its checkpoint."""

import glob
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest
import yaml
from toyrun import run, start

from trapo import runtime
from trapo.commands.reproduce.study import load_study
from trapo.config import ConfigError

ROOT = str(runtime.ROOT)
STUDIES = sorted(glob.glob(os.path.join(ROOT, "configs", "studies", "*", "*.yaml")))


def reproduce(*args, **kw):
    return subprocess.run(
        [sys.executable, "-m", "trapo", "reproduce", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=runtime.subprocess_env(),
        timeout=900,
        **kw,
    )


def test_the_five_studies_ship_for_the_toy_and_the_gpu_config():
    names = {(os.path.basename(os.path.dirname(p)), os.path.basename(p)[:-5]) for p in STUDIES}
    five = {"top_p", "gamma", "warmup", "select_method", "random_select"}
    # beside them the toy's curriculum study (issue 44), with its own report, and the label-efficient methods
    # (issue 65) at both scales
    extra = {("toy", "curriculum"), ("toy", "label_efficient"), ("gpu", "label_efficient")}
    extra |= {("real", "comparison")}  # issue 71: the paper's comparison on a real model, on CPU
    assert names == {(scale, name) for scale in ("toy", "gpu") for name in five} | extra


@pytest.mark.parametrize("scale", ["toy", "gpu"])
def test_a_condition_may_change_the_labeled_split_for_one_label_budget(scale, tmp_path):
    """label_efficient: the active conditions start with 3/4 of the labels the others have (the reproduction's
    split comes first in a launch, the condition's after it, so the condition's wins) and buy the rest."""
    from trapo.config import load_config

    path = os.path.join(ROOT, "configs", "studies", scale, "label_efficient.yaml")
    study = load_study(path)
    lines = reproduce("--study", path, "--print", "--out", str(tmp_path / "le")).stdout.splitlines()
    for line, (name, _) in zip(lines[:: len(study.seeds)], study.conditions.items()):
        argv = shlex.split(line)
        cfg = load_config(argv[argv.index("--config") + 1], [a for a in argv[argv.index("--config") + 2 :] if "=" in a])
        active = name.startswith("labels_")
        assert cfg.data.labeled_ratio == (0.1875 if active else 0.25), name
        assert cfg.labels.budget == (0 if not active else 16 if scale == "toy" else 256), name


@pytest.mark.parametrize("path", STUDIES, ids=lambda p: p.split("studies/")[1])
def test_print_lists_one_launch_per_condition_and_seed(path, tmp_path):
    study = load_study(path)
    out = reproduce("--study", path, "--print", "--out", str(tmp_path / study.name))
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and len(lines) == len(study.conditions) * len(study.seeds), out.stderr
    launcher = "deepspeed" if study.scale == "gpu" else sys.executable
    assert all(line.startswith(launcher) for line in lines)
    trained = [line for line in lines if " -m trapo eval " not in line]  # an untrained condition is evaluated
    assert len(trained) == (len(study.conditions) - len(study.untrained)) * len(study.seeds)
    assert all("resume_from=latest" in line for line in trained)
    assert len({line.split("run_name=")[1].split()[0] for line in trained}) == len(trained)


def test_the_centre_of_the_three_sweeps_is_one_set_of_runs(tmp_path):
    centres = []
    for name, centre in (("top_p", "p0.1"), ("gamma", "g0.5"), ("warmup", "w3")):
        out = reproduce("--study", f"configs/studies/toy/{name}.yaml", "--print", "--out", str(tmp_path / name))
        runs = {
            line.split("run_name=")[1].split()[0]
            for line in out.stdout.splitlines()
            if "selection.top_p=0.1" in line
            and "selection.threshold=0.5" in line
            and "selection.warmup_epochs=2" in line
        }
        centres.append(runs)
        assert len(runs) == 6, (name, centre)
    assert centres[0] == centres[1] == centres[2]


def test_a_bad_study_is_one_line(tmp_path):
    study = yaml.safe_load(open(os.path.join(ROOT, "configs", "studies", "toy", "top_p.yaml")))
    study["claims"][0]["worse"] = "p9"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(study))
    out = reproduce("--study", str(bad), "--print")
    assert (
        out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "worse: 'p9' is not a condition" in out.stderr
    )
    study["claims"][0]["worse"] = "p1.0"
    study["conditions"]["p1.0"] = ["selection.top_q=1.0"]
    bad.write_text(yaml.safe_dump(study))
    out = reproduce("--study", str(bad), "--print")
    assert out.returncode == 2 and "condition p1.0" in out.stderr and "did you mean 'selection.top_p'" in out.stderr


def bad_study(tmp_path, change) -> str:
    """configs/studies/toy/top_p.yaml with `change` applied, written to tmp_path; load_study's one line."""
    study = yaml.safe_load(open(os.path.join(ROOT, "configs", "studies", "toy", "top_p.yaml")))
    change(study)
    path = tmp_path / "top_p.yaml"
    path.write_text(yaml.safe_dump(study))
    with pytest.raises(ConfigError) as err:
        load_study(path)
    message = str(err.value)
    assert message.startswith(f"study {path}: ") and "\n" not in message
    return message[len(f"study {path}: ") :]


def test_a_misspelled_knob_stops_print_and_the_study_set_before_any_run(tmp_path):
    knob = bad_study(tmp_path, lambda s: s.update(knob="selection.top_q"))
    assert knob == "knob: key 'selection.top_q' is not a known setting; did you mean 'selection.top_p'?"
    out = reproduce("--study", str(tmp_path / "top_p.yaml"), "--print")
    assert (
        out.returncode == 2
        and out.stdout == ""
        and out.stderr == f"reproduce: study {tmp_path / 'top_p.yaml'}: {knob}\n"
    )
    # the set of studies (sensitivity.run_set) reads every file before its first run
    out = reproduce("--studies", str(tmp_path), "--out", str(tmp_path / "out"), "--docs", str(tmp_path / "docs"))
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and knob in out.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "docs").exists()


def test_every_field_of_a_study_file_is_checked_when_it_is_read(tmp_path):
    def fields(**kv):
        return lambda s: s.update(kv)

    def condition(name, overrides):
        return lambda s: s["conditions"].update({name: overrides})

    def claim(**kv):
        return lambda s: s["claims"][0].update(kv)

    def drop_split(s):
        del s["claims"][0]["split"]

    def strategy_knob(s):  # a setting, set by the condition, but not a number
        s.update(knob="selection.strategy")
        s["conditions"]["p0.1"].append("selection.strategy=tcs")

    c0 = "claims[0] (larger_top_p_hurts): "
    cases = [
        # the knob: a setting (not a section) that every condition sets to a number
        ("knob: key 'selection' is a section, not a setting; its keys: selection.", fields(knob="selection")),
        ("knob: got ['selection.top_p']; expected a dotted config key or null", fields(knob=["selection.top_p"])),
        (
            "knob: condition p0.1 does not set selection.threshold; give every condition "
            "selection.threshold=<value>, or set knob: null",
            fields(knob="selection.threshold"),
        ),
        (
            "knob: condition p0.1 sets selection.strategy=tcs, not a number (the results' x axis); set knob: null",
            strategy_knob,
        ),
        # the fields themselves
        ("knbo: not a study field; did you mean 'knob'?", fields(knbo="selection.top_p")),
        ("claims: missing; every study has name, title, scale, base", lambda s: s.pop("claims")),
        ("name: got 'a/b'; expected a plain name", fields(name="a/b")),
        ("scale: got 'tpy'; did you mean 'toy'?", fields(scale="tpy")),
        ("splits: a cpu study, and only a cpu study, names its split files", fields(scale="cpu")),
        ("splits: a cpu study, and only a cpu study", fields(splits={"test": "t.parquet"})),
        ("base: no config file configs/toy_trp.yaml", fields(base="configs/toy_trp.yaml")),
        ("seeds: got [0, 0]; expected a list of distinct integer seeds", fields(seeds=[0, 0])),
        ("quick_seeds: got '0,1'; expected a list of distinct integer seeds", fields(quick_seeds="0,1")),
        ("steps: got '32'; expected a whole number of steps", fields(steps="32")),
        ("steps: a toy study needs steps, a multiple of eval_every > 0", fields(steps=30)),
        ("common: got 'mode=trapo'; expected a list of overrides", fields(common="mode=trapo")),
        ("untrained: got 'p0.1'; expected a list of condition names, e.g. [base]", fields(untrained="p0.1")),
        ("untrained: 'p0.11' is not a condition of this study; did you mean 'p0.1'?", fields(untrained=["p0.11"])),
        ("untrained: only a study whose runs are scored on split files", fields(scale="gpu", untrained=["p0.1"])),
        ("scope: got ['x']; expected text", fields(scope=["x"])),
        # the conditions
        ("conditions: got []; expected a mapping of condition names to lists of overrides", fields(conditions=[])),
        (
            "conditions.p0.2: got 'selection.top_p=0.2'; expected a list of overrides (key=value), [] for none",
            condition("p0.2", "selection.top_p=0.2"),
        ),
        ("conditions: the name 0.2 is not a string; quote it ('0.2':)", condition(0.2, ["selection.top_p=0.2"])),
        # the claims and their keys
        (c0 + "'beter' is not a claim key; did you mean 'better'?", claim(beter="p0.1")),
        (c0 + "'split' is missing; every claim has name, better, worse, split", drop_split),
        (c0 + "worse: 'p0.9' is not a condition of this study; did you mean 'p0.7'?", claim(worse="p0.9")),
        (c0 + "split: got 'tset'; did you mean 'test'?", claim(split="tset")),
        (c0 + "better and worse are both p0.1; name two conditions", claim(worse="p0.1")),
        (
            "claims[2]: got 'p0.1 > p1.0'; expected a mapping with name, better",
            lambda s: s["claims"].append("p0.1 > p1.0"),
        ),
    ]
    for expected, change in cases:
        assert bad_study(tmp_path, change).startswith(expected), expected


@pytest.mark.toy_run
def test_a_tiny_study_runs_through_a_kill_and_resumes(tmp_path):
    study = {
        "name": "tiny",
        "title": "tiny",
        "scale": "toy",
        "base": "configs/toy_trap.yaml",
        "knob": "selection.top_p",
        "common": ["mode=trapo", "selection.warmup_epochs=1", "eval.n=1", "rollout.backend=hf"],
        "seeds": [0],
        "steps": 6,
        "eval_every": 2,
        "conditions": {"a": ["selection.top_p=0.1"], "b": ["selection.top_p=1.0"]},
        "claims": [{"name": "a_beats_b", "better": "a", "worse": "b", "split": "test", "means": "a smoke test"}],
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(study))
    out = tmp_path / "studies" / "tiny"
    args = [
        sys.executable,
        "-m",
        "trapo",
        "reproduce",
        "--study",
        str(path),
        "--tiny",
        "--jobs",
        "1",
        "--out",
        str(out),
    ]
    runs = tmp_path / "studies" / "runs"
    first = start(args)  # leading a process group of its own, which its runs join
    deadline = time.time() + 600
    finished, partial = None, None
    while time.time() < deadline and first.poll() is None:
        done = [d for d in runs.glob("*") if (d / "summary.json").is_file()]
        started = [d for d in runs.glob("*") if d not in done and list((d / "checkpoints").glob("step-*"))]
        if done and started:
            finished, partial = done[0], started[0]
            break
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)  # the runner and the run it was in
    first.wait()
    assert finished is not None and partial is not None, "no moment with one run finished and one mid-way"
    kept = (finished / "summary.json").stat().st_mtime
    second = run(args, timeout=900)
    assert second.returncode == 0, second.stderr[-3000:]
    assert (finished / "summary.json").stat().st_mtime == kept  # a finished run is kept
    starts = (partial / "starts.jsonl").read_text().splitlines()
    assert len(starts) == 2 and json.loads(starts[1])["step"] > 0  # the killed run resumed from its checkpoint
    res = json.loads((out / "results.json").read_text())
    assert set(res["conditions"]) == {"a", "b"} and res["claims"][0]["verdict"] in ("held", "not held", "inconclusive")
    assert "| a_beats_b | a smoke test |" in (out / "results.md").read_text()
    # the same study, never killed, in a store of its own: the same results
    straight = tmp_path / "straight" / "tiny"
    again = run([*args[:-1], str(straight)], timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((straight / "results.json").read_text()) == res


def test_a_cpu_study_scores_its_own_split_files_and_refuses_missing_ones(tmp_path):
    """configs/studies/real/comparison.yaml: the base config's model and data, the study's split files as
    eval.files, validation picking the best step; a split file not yet written stops the study before any run."""
    path = os.path.join(ROOT, "configs", "studies", "real", "comparison.yaml")
    study = load_study(path)
    assert study.scale == "cpu" and sorted(study.splits) == ["test", "test_ood", "validation"]
    lines = reproduce("--study", path, "--print", "--out", str(tmp_path / "rc")).stdout.splitlines()
    assert len(lines) == len(study.conditions) * len(study.seeds)
    files = ",".join(study.splits[s] for s in ("validation", "test", "test_ood"))
    argv = shlex.split(lines[len(study.seeds)])  # supervised, seed 0
    assert argv[1].endswith("trapo_train.py") and f"eval.files=[{files}]" in argv
    assert {"eval.select_on=validation", "eval.steps=5", "max_steps=20", "mode=supervised"} <= set(argv)
    # the base model is evaluated only, as the runs' validation scores them: greedy, the config's lengths
    base = shlex.split(lines[1])  # base, seed 1
    assert base[1:4] == ["-m", "trapo", "eval"] and base[base.index("--benchmarks") + 1] == files
    flags = {k: base[base.index(k) + 1] for k in ("--model", "--n", "--temperature", "--max-tokens", "--seed")}
    assert flags == {
        "--model": "./models/SmolLM2-135M-Instruct",
        "--n": "1",
        "--temperature": "0.0",
        "--max-tokens": "48",
        "--seed": "1",
    }
    assert base[base.index("--template") + 1] == "dataset" and base[base.index("--backend") + 1] == "vllm"
    bad = tmp_path / "study.yaml"
    raw = yaml.safe_load(open(path))
    raw["splits"]["validation"] = "outputs/nowhere/validation.parquet"  # the first split checked, on any clone
    bad.write_text(yaml.safe_dump(raw))
    out = reproduce("--study", str(bad), "--out", str(tmp_path / "rc2"))
    assert out.returncode == 2 and "splits: outputs/nowhere/validation.parquet not found" in out.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.toy_run
def test_an_untrained_condition_scores_as_a_run_that_cannot_move_its_weights(tmp_path):
    """A study's `untrained` condition (`trapo eval` of the base model) against a run of the same model whose
    updates are below float32's resolution (learning rate 1e-30): greedy, the same validation, ID and OOD
    scores, so the base model's row is what the runs' own validation would have said at no training cost."""
    study = {
        "name": "untrained",
        "title": "untrained",
        "scale": "toy",
        "base": "configs/toy_trap.yaml",
        "common": ["mode=trapo", "eval.n=1", "eval.temperature=0", "rollout.backend=hf"],
        "untrained": ["base"],
        "seeds": [0],
        "steps": 2,
        "eval_every": 2,
        "conditions": {"base": [], "frozen": ["train.lr=1e-30"]},
        "claims": [{"name": "same", "better": "frozen", "worse": "base", "split": "test", "means": "equal"}],
    }
    path = tmp_path / "untrained.yaml"
    path.write_text(yaml.safe_dump(study))
    out = tmp_path / "studies" / "untrained"
    done = run([sys.executable, "-m", "trapo", "reproduce", "--study", str(path), "--tiny", "--out", str(out)])
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    base, frozen = res["conditions"]["base"], res["conditions"]["frozen"]
    for split in ("validation", "test", "test_ood"):
        assert base[split]["per_seed"] == frozen[split]["per_seed"], split
    assert res["claims"][0]["interval"]["mean"] == 0.0
    evaluated = [d for d in (tmp_path / "studies" / "runs").iterdir() if (d / "results.json").is_file()]
    assert len(evaluated) == 1 and not (evaluated[0] / "checkpoints").exists()  # evaluated, never trained


@pytest.mark.parametrize(
    "child, said",
    [
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "was killed by SIGKILL (most often the kernel's"),
        ("import sys; print('step 3'); sys.exit('ConfigError: no such file')", "failed (exit 1): ConfigError: no such"),
    ],
)
def test_a_run_that_dies_is_one_line_naming_how_with_its_output_kept(child, said, tmp_path, monkeypatch):
    from trapo.commands.reproduce.forking import RunFailed
    from trapo.commands.reproduce.study import run_one

    monkeypatch.setenv("TRAPO_FORK_RUNS", "0")  # a fresh interpreter: no pre-imported parent for a two-line child
    run_dir = tmp_path / "runs" / "trapo-seed0"
    with pytest.raises(RunFailed) as failed:
        run_one(run_dir, [sys.executable, "-c", child], 4, print)
    line = str(failed.value)
    assert "\n" not in line and line.startswith(f"run trapo-seed0 {said}")
    assert line.endswith(f"its output: {run_dir / 'stderr.txt'}; the same command again keeps the finished runs")
    assert (run_dir / "stderr.txt").read_text() == ("ConfigError: no such file\n" if "exit" in said else "")
