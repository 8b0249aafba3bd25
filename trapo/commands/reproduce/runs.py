"""The reproduction's runs (child processes, forked from a pre-imported parent on CPU: `forking`, and
files): the one base model and its splits, the OOD setting's training file, one training run per method and
seed (reused when finished), the base model's evaluation, and reading a finished run's evaluation curve and
selection rows."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from trapo.commands.reproduce.forking import require_success, run_python
from trapo.commands.reproduce.plan import CONFIG, EVAL_EVERY, LABELED_RATIO, METHODS, ROOT
from trapo.commands.reproduce.study_file import SPLITS

# ---------------------------------------------------------------- runs


def build_base(docs_toy: dict, assets: Path, log) -> Path:
    """The one base model and its splits (trapo/commands/toy.py), built once from toy seed 0."""
    from trapo.commands.toy import build_assets
    from trapo.config import ToyConfig

    return build_assets(ToyConfig(**{**docs_toy, "enabled": True, "dir": str(assets), "seed": 0}), log=log)


def ood_train_file(root: Path, seed: int, dest: Path) -> Path:
    """The OOD setting's training file for a seed: the ID setting's 64 labeled + the unlabeled additions."""
    from trapo.data import load_questions

    labeled = [q for q in load_questions([str(root / "train.jsonl")], LABELED_RATIO, seed) if q.labeled]
    rows = [
        {"id": q.uid.split(":", 1)[1], "question": q.question, "answer": q.answer, "labeled": True} for q in labeled
    ]
    rows += [json.loads(x) for x in (root / "unlabeled_ood.jsonl").read_text().splitlines()]
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return dest


def run_one(out: Path, root: Path, method: str, seed: int, steps: int, extra: list[str], log) -> Path:
    run_dir = out / "runs" / f"{method}-seed{seed}"
    if (run_dir / "summary.json").is_file():
        import yaml

        done = yaml.safe_load((run_dir / "config.yaml").read_text())
        if done["max_steps"] == steps:
            log(f"{method} seed {seed}: reusing {run_dir}")
            return run_dir
        log(f"{method} seed {seed}: {run_dir} ran {done['max_steps']} steps, not {steps}: running again")
    if run_dir.exists():  # interrupted, or another budget: start it again from scratch
        shutil.rmtree(run_dir)
    setting, overrides = METHODS[method]
    if setting == "ood":
        train = [f"data.train_files=[{ood_train_file(root, seed, out / 'splits' / f'ood-seed{seed}.jsonl')}]"]
    else:
        train = [f"data.train_files=[{root / 'train.jsonl'}]", f"data.labeled_ratio={LABELED_RATIO}"]
    splits = ",".join(str(root / f"{name}.jsonl") for name in ("validation", "test", "test_ood"))
    args = [
        f"run_name={run_dir.name}",
        f"output_dir={run_dir.parent}",
        f"seed={seed}",
        f"max_steps={steps}",
        "progress_bar=false",
        "toy.enabled=false",
        f"model.path={root / 'model'}",
        *train,
        f"eval.files=[{splits}]",
        "eval.select_on=validation",
        f"eval.steps={EVAL_EVERY}",
        *overrides,
        *extra,
    ]
    started = time.perf_counter()
    proc = run_python([str(ROOT / "trapo_train.py"), "--config", str(CONFIG), *args], cwd=ROOT)
    require_success(proc, f"{method} seed {seed}", run_dir)
    log(f"{method} seed {seed}: {time.perf_counter() - started:.0f} s")
    return run_dir


def base_eval(out: Path, root: Path, cfg: dict, log) -> dict:
    """The base model under the runs' evaluation protocol (a reference row; not a candidate checkpoint)."""
    dest = out / "base"
    if not (dest / "results.json").is_file():
        ev = cfg["eval"]
        args = [
            "-m",
            "trapo",
            "eval",
            "--model",
            str(root / "model"),
            "--benchmarks",
            ",".join(str(root / f"{n}.jsonl") for n in ("validation", "test", "test_ood")),
            "--n",
            str(ev["n"]),
            "--temperature",
            str(ev["temperature"]),
            "--max-tokens",
            str(cfg["rollout"]["max_tokens"]),
            "--template",
            cfg["data"]["prompt_template"],
            "--max-prompt-tokens",
            str(cfg["data"]["max_prompt_tokens"]),
            "--seed",
            "0",
            "--out",
            str(dest),
            "--overwrite",
        ]
        proc = run_python(args, cwd=ROOT)
        require_success(proc, "the base model's evaluation", dest)
        log("base model evaluated")
    res = json.loads((dest / "results.json").read_text())["results"]
    return {name: r["score"] for name, r in res.items()}


def read_curve(run_dir: Path) -> list[dict]:
    """A run's evaluation curve, rows {"step", "validation", "test", "test_ood"} in step order; an untrained
    model's evaluation (`trapo eval`'s results.json, a study's `untrained` condition) is one row at step 0."""
    if not (run_dir / "metrics.jsonl").is_file() and (run_dir / "results.json").is_file():
        scores = json.loads((run_dir / "results.json").read_text())["results"]
        return [{"step": 0, **{k: scores[k]["score"] for k in SPLITS}}]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{"step": m["step"], **{k: m["eval"][k] for k in SPLITS}} for m in rows if "eval" in m]


def read_run(run_dir: Path) -> dict:
    """A run's evaluation curve and selection rows."""
    curve = read_curve(run_dir)
    sel = run_dir / "selection.jsonl"
    selection = [json.loads(x) for x in sel.read_text().splitlines()] if sel.is_file() else []
    return {"curve": curve, "selection": selection}
