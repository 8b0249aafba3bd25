"""Studies as data: a YAML file fixes, before any run, a base config, the conditions (override sets), the
seeds, the step budget and the claims with their direction; one runner runs it at any scale.

    python -m trapo reproduce --study configs/studies/toy/top_p.yaml [--print] [--jobs N] [--quick]

A study file (configs/studies/):
    name, title           the study's name (its output folder) and a line for the results
    scale                 toy: every run on the reproduction's base model and splits (trapo/commands/toy.py,
                          seed 0), one process each; cpu: the base config's own model and training data, here,
                          scored on `splits` (docs/real-model.md); gpu: the paper's config as it is, through
                          `deepspeed`
    splits                cpu scale: the validation, test and test_ood files
    untrained             conditions that are a model evaluated, not trained (the base model): scored once per
                          seed on the splits under the runs' validation protocol (`trapo eval`)
    scope                 what the study's scale can and cannot show (its report's page says it)
    base                  the config every run starts from
    knob                  the key the conditions vary (the results' x axis), or null
    common                overrides every condition gets
    conditions            name -> overrides
    seeds, quick_seeds    paired seeds: every condition runs every seed
    steps, eval_every     the step budget and the validation cadence (toy and cpu scales)
    claims                name, better, worse (condition names), split, means (what it says at this scale)

Every field is checked when the file is read (study_file.py), before any run or launch: one line naming the file,
the field and the fix (a misspelled knob gets the config schema's did-you-mean).

Each run is `trapo_train.py` with `resume_from=latest`: a finished run (summary.json, same budget) is kept, a
killed one resumes from its newest checkpoint (one that stopped before its first checkpoint starts over).
Runs live in one store beside the studies (`<out>/../runs/<key>-seed<s>`), keyed by the run's whole override
set: a condition two studies share (the centre of the three one-knob sweeps) runs once. A study with a report
records each finished run beside its page (`<docs>/runs/`, records.py): committed with the page, the records let
the study go on in another clone or on another machine, which runs only what no record covers.
`--print` lists the exact launch commands instead, one per condition and seed, for a cluster's scheduler.
Claims are read as in `make reproduce-toy`: per seed, the test accuracy at the best validation step of
`better` minus `worse`; 95% paired interval over the seeds; held / not held / inconclusive.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from trapo.commands.reproduce import records
from trapo.commands.reproduce.analysis import paired_interval, read_out, verdict
from trapo.commands.reproduce.forking import RunFailed, require_success, run_python
from trapo.commands.reproduce.plan import LABELED_RATIO, ROOT, TINY_TOY
from trapo.commands.reproduce.study_file import SPLITS, check_fields, check_knob
from trapo.config import ConfigError, load_config
from trapo.engine.memory_plan import choose


@dataclass
class Study:
    name: str
    title: str
    scale: str
    base: str
    conditions: dict[str, list[str]]
    seeds: list[int]
    claims: list[dict]
    knob: str | None = None
    common: list[str] = field(default_factory=list)
    quick_seeds: list[int] = field(default_factory=list)
    steps: int = 0
    eval_every: int = 0
    report: str | None = None  # long_runs (long_runs.py) or efficiency (efficiency.py): a report's claims and page
    toy_assets: str = "trap"  # toy scale: the reproduction's trap model and splits, or the base config's own toy
    splits: dict[str, str] | None = None  # cpu scale: the validation, test and test_ood files
    untrained: list[str] = field(default_factory=list)  # conditions evaluated only (`evaluation_argv`)
    scope: str = ""  # what this scale can and cannot show, for the report's page
    path: str = ""

    def seeds_for(self, quick: bool) -> list[int]:
        """The paired seeds a run of the study takes: all, or with --quick its quick seeds (else the first 2)."""
        return (self.quick_seeds or self.seeds[:2]) if quick else self.seeds


def load_study(path: str | Path) -> Study:
    """A study file, checked whole before any run: every field (study_file.check_fields: the knob against the
    config schema, the conditions, the claims and their keys), then every condition's config (loaded with its
    overrides, so a bad key or value names the study and the condition)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"study {path}: cannot read it ({err})") from None
    check_fields(raw, path, ROOT)
    study = Study(**raw, path=str(path))
    here = study.scale in ("toy", "cpu")
    if here and not (study.steps > 0 and study.eval_every > 0 and study.steps % study.eval_every == 0):
        raise ConfigError(f"study {path}: steps: a {study.scale} study needs steps, a multiple of eval_every > 0")
    for name, overrides in study.conditions.items():
        try:
            load_config(str(ROOT / study.base), [*study.common, *overrides])
        except ConfigError as err:
            raise ConfigError(f"study {path}: condition {name}: {err}") from None
    check_knob(study.knob, study.conditions, path)
    return study


def toy_config(out: Path, tiny: bool = False, study: Study | None = None):
    """The toy-scale base model and splits (as `make reproduce-toy` builds them), shared by the studies beside
    `out`; with toy_assets: base, the base config's own toy section instead."""
    from trapo.config import ToyConfig

    if study is not None and study.toy_assets == "base":
        toy = load_config(str(ROOT / study.base), [*study.common, *_tiny_base(tiny)]).toy
        return dataclasses.replace(toy, dir=str(out.parent / "base-assets"))
    return ToyConfig(**toy_settings(tiny), dir=str(out.parent / "base-assets"))


def _tiny_base(tiny: bool) -> list[str]:
    """The test suite's tiny toy as overrides of a base config's own toy (an addition toy has no OOD split)."""
    skip = ("unlabeled_ood", "validation")
    return [f"toy.{k}={v}" for k, v in TINY_TOY.items() if k not in skip] if tiny else []


def toy_root(out: Path, tiny: bool = False) -> Path:
    """Where the trap base model and splits are built, shared by the studies beside `out`."""
    return toy_config(out, tiny).asset_dir


def toy_settings(tiny: bool) -> dict:
    toy = dict(yaml.safe_load((ROOT / "configs" / "toy_trap.yaml").read_text())["toy"])
    if tiny:  # the test suite's study: every path, a few questions
        toy.update(TINY_TOY)
    toy.pop("dir", None)  # the studies' own, beside them
    return {**toy, "enabled": True, "seed": 0}


def run_key(study: Study, overrides: list[str]) -> str:
    """The run store's name for a condition: its whole override set, hashed (order does not matter)."""
    import hashlib

    text = "\n".join(sorted([study.base, *study.common, *overrides]))
    return hashlib.blake2b(text.encode(), digest_size=5).hexdigest()


def launches(study: Study, out: Path, seeds: list[int], tiny: bool = False) -> list[tuple[str, int, Path, list[str]]]:
    """(condition, seed, run directory, argv) of every run, in condition-major order."""
    runs = []
    root = toy_root(out, tiny) if study.scale == "toy" and study.toy_assets == "trap" else None
    own = study.scale == "toy" and study.toy_assets == "base"  # the base config's own toy, built beside the runs
    scored = {s: root / f"{s}.jsonl" for s in SPLITS} if root is not None else study.splits
    for name, overrides in study.conditions.items():
        for seed in seeds:
            run_dir = out.parent / "runs" / f"{run_key(study, overrides)}-seed{seed}"
            if name in study.untrained:  # the model as it is, scored as the runs' validation scores theirs
                model = root / "model" if root is not None else None
                runs.append((name, seed, run_dir, evaluation_argv(study, overrides, model, scored, seed, run_dir)))
                continue
            args = [f"run_name={run_dir.name}", f"output_dir={run_dir.parent}", f"seed={seed}", "resume_from=latest"]
            if root is not None or study.scale == "cpu":  # a run here, scored on the three splits
                args += [f"max_steps={study.steps}", "progress_bar=false"]
                if root is not None:  # the trap toy's model and training file, not the base config's
                    args += ["toy.enabled=false", f"model.path={root / 'model'}"]
                    args += [f"data.train_files=[{root / 'train.jsonl'}]"]
                args += [
                    f"eval.files=[{','.join(str(scored[s]) for s in SPLITS)}]",
                    "eval.select_on=validation",
                    f"eval.steps={study.eval_every}",
                    f"save_steps={study.eval_every}",
                ]
                if tiny and root is not None:  # the test suite's study: a few questions per batch
                    args += ["train.rollout_batch_size=16", "train.update_batch_size=16"]
                cmd = [sys.executable, str(ROOT / "trapo_train.py")]
            elif own:
                args += [f"max_steps={study.steps}", "progress_bar=false", f"toy.dir={out.parent / 'base-assets'}"]
                args += [f"save_steps={study.eval_every}"]
                if tiny:
                    args += [*_tiny_base(tiny), "train.rollout_batch_size=16", "train.update_batch_size=16"]
                cmd = [sys.executable, str(ROOT / "trapo_train.py")]
            else:
                cmd = ["deepspeed", str(ROOT / "trapo_train.py")]
            # the reproduction's labeled split comes first, so that a condition may change it (label budgets)
            split = [f"data.labeled_ratio={LABELED_RATIO}"] if root is not None else []
            config = ["--config", str(ROOT / study.base), *split, *study.common, *overrides]
            runs.append((name, seed, run_dir, [*cmd, *config, *args]))
    return runs


def evaluation_argv(study: Study, overrides: list[str], model: Path | None, files: dict, seed: int, out: Path):
    """`trapo eval` of a condition's model (its config's model.path, or `model`) on the split `files`, with the
    settings the trainer's validation uses (eval.n at eval.temperature, seeded per question by the run's seed,
    the config's template, lengths, verifier, backend and hf batches), its samples and results.json into `out`."""
    cfg = load_config(str(ROOT / study.base), [*study.common, *overrides])
    cfg = choose(cfg, 1, None, None).apply(cfg)  # the auto settings as a run here takes them (no GPU plan)
    e, r = cfg.eval, cfg.rollout
    args = ["-m", "trapo", "eval", "--model", str(model or cfg.model.path), "--benchmarks"]
    args += [",".join(str(files[s]) for s in SPLITS), "--n", str(e.n), "--temperature", str(e.temperature)]
    args += ["--max-tokens", str(e.max_tokens or r.max_tokens), "--template", cfg.data.prompt_template]
    args += ["--max-prompt-tokens", str(cfg.data.max_prompt_tokens), "--seed", str(seed), "--backend", r.backend]
    args += ["--hf-max-batch", str(r.hf_max_batch), "--hf-decoding", r.hf_decoding]  # the hf engine's batches
    args += ["--verifier", cfg.reward.verifier, "--out", str(out), "--no-progress"]
    return [sys.executable, *args]


def finished(run_dir: Path, steps: int) -> bool:
    """A training run that ended with this step budget, or an untrained condition's finished evaluation."""
    if (run_dir / "results.json").is_file():
        return True
    if not (run_dir / "summary.json").is_file():
        return False
    return yaml.safe_load((run_dir / "config.yaml").read_text()).get("max_steps") == steps


def run_one(run_dir: Path, argv: list[str], steps: int, log) -> Path:
    """One run: kept when finished with this budget, resumed when killed after a checkpoint, else (re)started
    (an evaluation: resumed from its samples)."""
    if finished(run_dir, steps):
        return run_dir
    evaluation = argv[1:3] == ["-m", "trapo"]
    if not evaluation and run_dir.exists() and not list((run_dir / "checkpoints").glob("step-*")):
        shutil.rmtree(run_dir)  # it stopped before its first checkpoint: nothing to resume
    started = time.perf_counter()
    proc = run_python(argv[1:], cwd=ROOT)  # a study's launch here, `python trapo_train.py ...` (`launches`)
    require_success(proc, f"run {run_dir.name}", run_dir)
    log(f"{run_dir.name}: {time.perf_counter() - started:.0f} s")
    return run_dir


def analyse(study: Study, curves: dict[tuple[str, int], list[dict]], seeds: list[int]) -> dict:
    """Per condition the test accuracies at the best validation step (per seed, mean); per claim the paired
    interval of better - worse and its verdict."""
    picked = {key: read_out(curve, study.steps, "best_validation") for key, curve in curves.items()}
    conditions = {}
    for name in study.conditions:
        per_seed = {split: [picked[(name, s)][split] for s in seeds] for split in SPLITS}
        conditions[name] = {split: {"per_seed": v, "mean": sum(v) / len(v)} for split, v in per_seed.items()}
    claims = []
    for claim in (c for c in study.claims if "metric" not in c):  # metric claims: the study's report reads them
        split = claim["split"]
        diffs = [picked[(claim["better"], s)][split] - picked[(claim["worse"], s)][split] for s in seeds]
        interval = paired_interval(diffs)
        claims.append({**claim, "interval": interval, "verdict": verdict(interval)})
    return {
        "study": study.name,
        "title": study.title,
        "knob": study.knob,
        "seeds": seeds,
        "steps": study.steps,
        "conditions": conditions,
        "claims": claims,
    }


def markdown(res: dict) -> str:
    lines = [
        f"## {res['title']}",
        "",
        f"{len(res['seeds'])} paired seeds, {res['steps']} steps; test accuracy at "
        "the best validation step (mean over seeds).",
        "",
    ]
    lines += ["| condition | ID test | OOD test |", "|---|---|---|"]
    for name, c in res["conditions"].items():
        lines.append(f"| {name} | {c['test']['mean']:.3f} | {c['test_ood']['mean']:.3f} |")
    lines += ["", "| claim | what it means here | mean difference [95% interval] | verdict |", "|---|---|---|---|"]
    for c in res["claims"]:
        i = c["interval"]
        lines.append(
            f"| {c['name']} | {c.get('means', '')} | {i['mean']:+.3f} [{i['low']:+.3f}, {i['high']:+.3f}] "
            f"| {c['verdict']} |"
        )
    return "\n".join(lines) + "\n"


def run_study(study: Study, out: Path, seeds: list[int], jobs: int, tiny: bool, log, docs: Path | None = None) -> dict:
    """Every condition and seed (finished runs kept, killed ones resumed, a study with a report: recorded ones
    under `docs` not run again), then the analysis into `out` (a study with a report: its report does it)."""
    from concurrent.futures import ThreadPoolExecutor

    from trapo.commands.reproduce.runs import read_run

    if study.scale == "gpu":
        raise ConfigError(f"study {study.path}: a gpu study runs on a cluster; print its launches with --print")
    if study.scale == "cpu":
        missing = [study.splits[s] for s in SPLITS if not (ROOT / study.splits[s]).is_file()]
        if missing:
            raise ConfigError(
                f"study {study.path}: splits: {missing[0]} not found; write it first (make word-problems)"
            )
    else:
        from trapo.commands.toy import build_assets

        build_assets(toy_config(out, tiny, study), log=log)
    runs = unrecorded(study, launches(study, out, seeds, tiny), docs)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {(n, s): pool.submit(run_one, d, argv, study.steps, log) for n, s, d, argv in runs}
        dirs = {key: f.result() for key, f in futures.items()}
    if study.report is not None or study.toy_assets == "base":  # the report reads the runs (report_values)
        return {}
    res = analyse(study, {key: read_run(d)["curve"] for key, d in dirs.items()}, seeds)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    (out / "results.md").write_text(markdown(res))
    return res


def main(args) -> int:
    """`reproduce --study FILE`: print the launches, or run the study (toy scale) and analyse it."""
    try:
        study = load_study(args.study)
    except ConfigError as err:
        print(f"reproduce: {err}", file=sys.stderr)
        return 2
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else study.seeds_for(args.quick)
    out = args.out or Path("outputs/studies") / study.name
    try:
        chosen = subset(study, getattr(args, "conditions", None))
    except ConfigError as err:
        print(f"reproduce: {err}", file=sys.stderr)
        return 2
    if args.print:
        for _, _, _, argv in launches(chosen, out, seeds, args.tiny):
            print(shlex.join(argv))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    try:
        res = run_study(chosen, out, seeds, args.jobs, args.tiny, _log, args.docs or out)
    except ConfigError as err:  # a gpu study asked to run here, a cpu study's split file not written yet
        print(f"reproduce: {err}", file=sys.stderr)
        return 2
    except RunFailed as err:  # the runs finished before it are kept; the report waits for every run
        print(f"reproduce: {err}", file=sys.stderr)
        return 1
    if res:
        print(markdown(res))
    if study.report is not None:  # every finished run of the study, these seeds and conditions or earlier ones
        if study.report == "long_runs":
            from trapo.commands.reproduce.long_runs import run_values, write_report
        elif study.report == "comparison":
            from trapo.commands.reproduce.comparison import run_values, write_report
        else:
            from trapo.commands.reproduce.efficiency import run_values, write_report

        runs = launches(study, out, sorted(set(study.seeds) | set(seeds)), args.tiny)
        try:
            values = report_values(study, runs, args.docs or out, run_values)
        except ConfigError as err:  # a damaged record
            print(f"reproduce: {err}", file=sys.stderr)
            return 2
        print(write_report(study, values, args.docs or out))
    return 0


def _log(message: str) -> None:
    print(f"[study] {message}", file=sys.stderr)


def _recorded(study: Study, run: tuple, docs: Path) -> dict | None:
    """The record under `docs` of a launch (condition, seed, run directory, argv), when it is of this launch."""
    _, _, run_dir, argv = run
    return records.read(records.path(docs, run_dir), records.portable(argv, run_dir), study.steps)


def unrecorded(study: Study, runs: list[tuple], docs: Path | None) -> list[tuple]:
    """The launches to run: a study with a report leaves out those recorded under `docs` and not here (finished
    on another machine); one finished here stays (run_one keeps it, report_values re-records it)."""
    if study.report is None or docs is None:
        return runs
    return [r for r in runs if finished(r[2], study.steps) or _recorded(study, r, docs) is None]


def report_values(study: Study, runs: list[tuple], docs: Path, run_values) -> dict[tuple[str, int], dict]:
    """(condition, seed) -> the report's values of each run that finished: read from its directory (and recorded
    under `docs`) when it finished here, else from its record (finished on another machine); plus its wall time
    (`seconds`, None for an evaluation)."""
    values = {}
    for name, seed, run_dir, argv in runs:
        path, launch = records.path(docs, run_dir), records.portable(argv, run_dir)
        if finished(run_dir, study.steps):
            record = records.write(path, name, seed, study.steps, launch, run_values(run_dir), run_dir)
        else:
            record = records.read(path, launch, study.steps)
        if record is not None:
            values[(name, seed)] = {**record["values"], "seconds": record["seconds"]}
    return values


def subset(study: Study, names: str | None) -> Study:
    """The study with only the named conditions (a comma list) and the claims between them; None: all."""
    if not names:
        return study
    wanted = [n.strip() for n in names.split(",")]
    for name in wanted:
        if name not in study.conditions:
            raise ConfigError(
                f"--conditions: {name!r} is not a condition of {study.path}; it has {', '.join(study.conditions)}"
            )
    claims = [c for c in study.claims if c["better"] in wanted and c["worse"] in wanted]
    return dataclasses.replace(study, conditions={n: study.conditions[n] for n in wanted}, claims=claims)
