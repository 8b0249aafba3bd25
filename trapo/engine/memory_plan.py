"""Memory plan: per-GPU bytes of a run at its three moments, from the config alone (no GPU, no weights), what
it chooses for the auto settings, and whether the run fits.

    plan = memory_plan(cfg, world=8, gpu_bytes=80 * GiB, arch=model_arch(cfg.model.path), ds_config=ds)

The terms of each phase: memory_terms.py. Where each comes from in the pinned deepspeed, vLLM and transformers
(file:line, dated), and the one term a GPU has measured: docs/memory-plan.md, "Where each term comes from".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from trapo.config import Config, ConfigError
from trapo.engine.memory_terms import GiB, Item, Zero, check_stage, peak, phases, zero_settings
from trapo.engine.model_shapes import Arch


@dataclass
class Plan:
    arch: Arch
    world: int
    gpu_bytes: int
    tokens: int  # T, tokens of the largest micro-batch
    phases: dict[str, list[Item]]  # "start-up", "rollout", "update"
    kv: dict[str, int]  # kv_cache_bytes, bytes_per_token, sequence_tokens, sequences_held, sequences_needed
    problems: list[str]  # each names the setting to change
    warnings: list[str]
    placement: str = "colocated"  # rollout.placement; separate: trapo/engine/memory_plan_separate.py
    rollout_ranks: int = 0  # separate: the GPUs of `world` that hold only an engine
    choices: Choices | None = None  # what the plan decided for the auto settings, and why (`choose`)

    @property
    def checkpointing(self) -> tuple[bool, str]:
        return self.choices.checkpointing

    @property
    def fits(self) -> bool:
        return not self.problems

    def peak(self, phase: str) -> int:
        return sum(i.bytes for i in self.phases[phase] if i.counted)


def without_engine(cfg: Config) -> Config:
    """`cfg` as its training GPUs run it under rollout.placement separate: no engine beside the trainer (the hf
    backend's plan, whose rollout phase is the policy's own and is dropped), one GPU a rank."""
    return replace(cfg, rollout=replace(cfg.rollout, backend="hf", tensor_parallel_size=1))


def _checkpointed(cfg: Config, on: bool) -> Config:
    return replace(cfg, model=replace(cfg.model, gradient_checkpointing=on))


def checkpointing_needed(
    cfg: Config, world: int, gpu_bytes: int | None, arch: Arch | None, ds_config: dict | None = None
) -> tuple[bool, str]:
    """(whether the update recomputes each layer, why): the one place that decides model.gradient_checkpointing.

    true and false are obeyed. auto is on only where the update phase of the plan, counted without
    checkpointing, exceeds `gpu_bytes` (recomputing costs about a third more FLOPs in the update); only the
    update holds activations, so a start-up or rollout that does not fit is not checkpointing's to fix.
    gpu_bytes None or 0 is a CPU run: the plan has no device memory to fit (`memory_plan` refuses it; the
    doctor shows no plan there) and plans no host memory, so auto is off there. arch None (the plan cannot
    read the model's architecture), or a run the plan cannot size: on, the choice that cannot run out of
    memory for want of it. world: the GPUs that train (with rollout.placement separate, those without an engine)."""
    setting = cfg.model.gradient_checkpointing
    if setting != "auto":
        return bool(setting), f"model.gradient_checkpointing={str(bool(setting)).lower()}"
    if not gpu_bytes:
        return False, "auto: no GPU, so no memory plan to fit"
    if arch is None:
        return True, "auto: the memory plan cannot read the model's architecture"
    cfg, sizes = _settled(cfg), _Sizes(world, gpu_bytes, arch, ds_config)  # separate placement: its trainers
    gib = lambda n: f"{n / GiB:.1f}"  # noqa: E731
    try:
        without = sizes.peaks(_checkpointed(cfg, False))["update"]
        if without <= gpu_bytes:
            return False, f"auto: the update fits in {gib(without)} of {gib(gpu_bytes)} GiB without it"
        with_it = sizes.peaks(_checkpointed(cfg, True))["update"]
    except ConfigError as err:
        return True, f"auto: the memory plan cannot size the update ({err})"
    return True, f"auto: the update needs {gib(without)} of {gib(gpu_bytes)} GiB without it, {gib(with_it)} with it"


def checkpointing_line(on: bool, why: str) -> str:
    """The trainer's start-up line (and the plan's) saying what `checkpointing_needed` decided."""
    return f"gradient checkpointing: {'on' if on else 'off'} ({why})"


# Where no plan decides (CPU, a model the plan cannot read): the LM head's chunk and the hf backend's rows.
CPU_CHUNK, CPU_ROWS = 256, 256
# Where it fits, the LM head's chunk is at least this: at 256 the update measured 1.15-1.18x the time of full
# logits on an H200 (docs/gpus.md), and a chunk of 2048 rows keeps its matrix products large.
CHUNK_FLOOR = 2048
SPARE = 0.1  # the hf backend's rows are taken with this share of the card left: the plan's terms are estimates


@dataclass(frozen=True)
class Choices:
    """What the plan decided for a run's auto settings, each (value, why): model.gradient_checkpointing,
    train.param_persistence, train.loss_chunk_tokens and, with the hf backend, rollout.hf_max_batch (None with
    vLLM, which sizes its own batches)."""

    checkpointing: tuple[bool, str]
    persistence: tuple[bool, str]
    loss_chunk: tuple[int, str]
    hf_rows: tuple[int, str] | None

    def apply(self, cfg: Config) -> Config:
        """`cfg` as the run executes it: each choice in its setting's place."""
        rows = _setting(cfg.rollout.hf_max_batch, CPU_ROWS) if self.hf_rows is None else self.hf_rows[0]
        return replace(
            cfg,
            model=replace(cfg.model, gradient_checkpointing=self.checkpointing[0]),
            train=replace(cfg.train, param_persistence=self.persistence[0], loss_chunk_tokens=self.loss_chunk[0]),
            rollout=replace(cfg.rollout, hf_max_batch=rows),
        )

    def lines(self) -> list[str]:
        """One line per choice: the trainer says them at start-up, `doctor --plan` prints them."""
        persistent, (chunk, chunk_why) = self.persistence, self.loss_chunk
        out = [
            checkpointing_line(*self.checkpointing),
            f"ZeRO-3 parameter persistence: {'on' if persistent[0] else 'off'} ({persistent[1]})",
            f"LM-head loss chunk: {chunk} tokens ({chunk_why})",
        ]
        if self.hf_rows is not None:
            out.append(f"hf rows generated at once: {self.hf_rows[0]} ({self.hf_rows[1]})")
        return out


def _setting(value, cpu):
    """A setting's value where no plan decides: its own, or `cpu` for auto."""
    return cpu if value == "auto" else value


def _settled(cfg: Config) -> Config:
    """`cfg` with the auto settings other than gradient checkpointing at their values where no plan decides:
    what checkpointing is decided with (it comes first), and what a CPU run takes."""
    t, r = cfg.train, cfg.rollout
    return replace(
        cfg,
        train=replace(
            t, param_persistence=t.param_persistence is True, loss_chunk_tokens=_setting(t.loss_chunk_tokens, CPU_CHUNK)
        ),
        rollout=replace(r, hf_max_batch=_setting(r.hf_max_batch, CPU_ROWS)),
    )


def choose(cfg: Config, world: int, gpu_bytes: int | None, arch: Arch | None, ds_config: dict | None = None) -> Choices:
    """The one place that decides the auto settings, each counted with those decided before it: gradient
    checkpointing (`checkpointing_needed`), the hf backend's rows, ZeRO-3 parameter persistence, the LM head's
    chunk. An explicit setting is obeyed; with no GPU (gpu_bytes None) or an architecture the plan cannot read,
    the CPU defaults. world: the GPUs that train (with rollout.placement separate, those without an engine)."""
    t, r = cfg.train, cfg.rollout
    planned = _settled(cfg)
    checkpointing = checkpointing_needed(cfg, world, gpu_bytes, arch, ds_config)
    planned = _checkpointed(planned, checkpointing[0])
    persistence = (planned.train.param_persistence, f"train.param_persistence={str(t.param_persistence).lower()}")
    chunk = (planned.train.loss_chunk_tokens, f"train.loss_chunk_tokens={t.loss_chunk_tokens}")
    rows = (planned.rollout.hf_max_batch, f"rollout.hf_max_batch={r.hf_max_batch}") if r.backend == "hf" else None
    unplanned = "auto: no GPU, so no memory plan to fit" if not gpu_bytes else None
    if gpu_bytes and arch is None:
        unplanned = "auto: the memory plan cannot read the model's architecture"
    try:
        sizes = None if unplanned else _Sizes(world, gpu_bytes, arch, ds_config)
        if sizes and rows is not None and r.hf_max_batch == "auto":  # the rollout's own: the choices below keep it
            separate = "auto: rollout.placement separate, whose rollout GPUs this plan does not size"
            rows = (CPU_ROWS, separate) if r.placement == "separate" else _hf_rows(sizes, planned)
            planned = replace(planned, rollout=replace(planned.rollout, hf_max_batch=rows[0]))
        if sizes and t.param_persistence == "auto":
            persistence = _persistence(sizes, planned)
            planned = replace(planned, train=replace(planned.train, param_persistence=persistence[0]))
        if sizes and t.loss_chunk_tokens == "auto":
            chunk = _loss_chunk(sizes, planned)
    except ConfigError as err:
        unplanned = f"auto: the memory plan cannot size the run ({err})"
    if unplanned:  # each auto setting at the value it had before any plan chose
        persistence = (False, unplanned) if t.param_persistence == "auto" else persistence
        chunk = (CPU_CHUNK, unplanned) if t.loss_chunk_tokens == "auto" else chunk
        rows = (CPU_ROWS, unplanned) if rows is not None and r.hf_max_batch == "auto" else rows
    return Choices(checkpointing, persistence, chunk, rows)


@dataclass(frozen=True)
class _Sizes:
    """Each phase's peak for a config on `world` GPUs of `gpu` bytes, as `memory_plan` counts it."""

    world: int
    gpu: int
    arch: Arch
    ds_config: dict | None

    def peaks(self, cfg: Config) -> dict[str, int]:
        if cfg.rollout.placement == "separate":  # the training GPUs: no engine beside the trainer
            cfg = without_engine(cfg)
        b = 4 if cfg.model.dtype == "float32" else 2
        T = max(cfg.train.micro_batch_tokens, cfg.data.max_prompt_tokens + cfg.rollout.max_tokens)
        z, util = zero_settings(self.ds_config, b), cfg.rollout.gpu_memory_utilization
        ph, kv = phases(cfg, self.world, self.gpu, self.arch, z, util, T)
        return {name: peak(items) for name, items in ph.items()} | {"needed": kv["sequences_needed"], "T": T}

    def gib(self, n: int) -> str:
        return f"{n / GiB:.1f} of {self.gpu / GiB:.1f} GiB"


def _persistence(sizes: _Sizes, cfg: Config) -> tuple[bool, str]:
    """auto: on where one GPU trains under ZeRO-3 and every phase still fits with the whole model kept
    gathered (on several GPUs that copy would undo the partitioning ZeRO-3 is for)."""
    if zero_settings(sizes.ds_config, 2).stage != 3:
        return False, "auto: ZeRO-2 holds the parameters whole already"
    if sizes.world != 1:
        return False, f"auto: {sizes.world} GPUs train, and ZeRO-3 partitions the parameters over them"
    persistent = sizes.peaks(replace(cfg, train=replace(cfg.train, param_persistence=True)))
    over = [p for p in ("start-up", "rollout", "update") if persistent[p] > sizes.gpu]
    if over:
        return (
            False,
            f"auto: with the whole model kept gathered the {over[0]} would need {sizes.gib(persistent[over[0]])}",
        )
    return True, f"auto: one GPU; with the whole model kept gathered the update needs {sizes.gib(persistent['update'])}"


def _loss_chunk(sizes: _Sizes, cfg: Config) -> tuple[int, str]:
    """auto: the largest chunk (a power of two from CPU_CHUNK, or the whole micro-batch) whose fp32 logits fit
    beside the update's peak, that is leave it where the rest of the update puts it; at least CHUNK_FLOOR
    wherever that fits the card (its logits may then raise the peak a little)."""
    T = sizes.peaks(cfg)["T"]
    candidates = [c for c in (2**k for k in range(8, 40)) if c < T] + [T]
    update = {c: sizes.peaks(replace(cfg, train=replace(cfg.train, loss_chunk_tokens=c)))["update"] for c in candidates}
    least = update[candidates[0]]
    if least > sizes.gpu:
        return CPU_CHUNK, f"auto: the update does not fit even at {candidates[0]} tokens (see the plan's problems)"
    beside = max(c for c in candidates if update[c] <= least)
    floor = max(c for c in candidates if c <= CHUNK_FLOOR and update[c] <= sizes.gpu)
    if beside >= floor:
        return beside, f"auto: the largest whose logits leave the update at {sizes.gib(update[beside])}"
    return floor, f"auto: at least {CHUNK_FLOOR} where it fits; the update needs {sizes.gib(update[floor])}"


def _hf_rows(sizes: _Sizes, cfg: Config) -> tuple[int, str]:
    """auto: the most of the rank's sequences (at most all of them) generated at once whose rollout phase fits
    with SPARE of the card left (else the most that fit at all)."""

    def rollout(rows: int) -> int:
        return sizes.peaks(replace(cfg, rollout=replace(cfg.rollout, hf_max_batch=rows)))["rollout"]

    needed = sizes.peaks(cfg)["needed"]
    for limit, spare in ((1 - SPARE) * sizes.gpu, ", with a tenth of the card to spare"), (sizes.gpu, ""):
        if rollout(1) > limit:
            continue
        lo, hi = 1, needed  # the rollout's peak grows with the rows: the largest that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if rollout(mid) <= limit else (lo, mid - 1)
        every = f"all {needed} of the rank's sequences" if lo == needed else f"{lo} of the rank's {needed} sequences"
        return lo, f"auto: {every}; the rollout needs {sizes.gib(rollout(lo))}{spare}"
    return CPU_ROWS, "auto: the rollout does not fit even with one row (see the plan's problems)"


def _bounds(ph: dict, kv: dict, gpu: int, sequences: int) -> tuple[float, float]:
    """(lowest rollout.gpu_memory_utilization holding `sequences`, highest that fits beside the trainer)."""
    low = (kv["vllm_fixed"] + sequences * kv["sequence_bytes"]) / gpu
    trainer = max(peak(ph[p]) - _vllm(ph[p]).bytes for p in ("start-up", "rollout"))
    return low, (gpu - trainer) / gpu


def _up(x: float) -> float:  # a utilisation to suggest, in hundredths
    return math.ceil(x * 100 - 1e-9) / 100


def _down(x: float) -> float:
    return math.floor(x * 100 + 1e-9) / 100


def _vllm(items: list[Item]) -> Item:
    return next(i for i in items if i.name.startswith("vLLM: rollout"))


def _fits(cfg, world, gpu, arch, z, util, T) -> bool:
    ph, kv = phases(cfg, world, gpu, arch, z, util, T)
    return kv["sequences_held"] >= 1 and all(peak(ph[p]) <= gpu for p in ph)


def _more_gpus(cfg: Config, world: int, gpu: int, arch: Arch, z: Zero, T: int) -> str:
    """The smallest world size (dividing the batch sizes, a multiple of tp) at which some utilisation fits."""
    t, tp = cfg.train, cfg.rollout.tensor_parallel_size
    for w in range(world + 1, 4097):
        if t.rollout_batch_size % w or t.update_batch_size % w or w % tp:
            continue
        if cfg.rollout.backend == "hf":  # no vLLM share to choose
            if _fits(cfg, w, gpu, arch, z, 0.5, T):
                return f"at least {w} GPUs of this size (--gpus {w})"
            continue
        low, high = _bounds(*phases(cfg, w, gpu, arch, z, 0.5, T), gpu, 1)
        util = _up(low)
        if util <= high and _fits(cfg, w, gpu, arch, z, util, T):
            return f"at least {w} GPUs of this size (--gpus {w}, rollout.gpu_memory_utilization={util:.2f})"
    return f"no GPU count fits cards of {gpu / GiB:g} GiB: a larger card, or a smaller model.path"


def memory_plan(cfg: Config, world: int, gpu_bytes: int, arch: Arch, ds_config: dict | None = None) -> Plan:
    """The plan for `cfg` on `world` GPUs of `gpu_bytes` each. ds_config: the parsed train.deepspeed_config
    (None: DeepSpeed's defaults, bf16 gradient accumulation). Problems and warnings name the setting to change."""
    r, t = cfg.rollout, cfg.train
    if world < 1 or gpu_bytes <= 0:
        raise ConfigError(f"the plan needs at least one GPU with memory, got {world} x {gpu_bytes} bytes")
    if world % r.tensor_parallel_size or t.rollout_batch_size % world or t.update_batch_size % world:
        raise ConfigError(
            f"{world} GPUs: must be a multiple of rollout.tensor_parallel_size ({r.tensor_parallel_size}) and "
            f"divide train.rollout_batch_size ({t.rollout_batch_size}) and train.update_batch_size "
            f"({t.update_batch_size})"
        )
    b = 4 if cfg.model.dtype == "float32" else 2
    z, util, seq = zero_settings(ds_config, b), r.gpu_memory_utilization, cfg.data.max_prompt_tokens + r.max_tokens
    check_stage(z.stage, cfg.model.lora.rank)
    choices = choose(cfg, world, gpu_bytes, arch, ds_config)
    cfg = choices.apply(cfg)  # every phase and hint below counts the choices (the auto settings decided)
    T = max(t.micro_batch_tokens, seq)
    ph, kv = phases(cfg, world, gpu_bytes, arch, z, util, T)
    hf = r.backend == "hf"
    low, high = (0.0, 1.0) if hf else _bounds(ph, kv, gpu_bytes, 1)
    gib = lambda n: f"{n / GiB:.1f} GiB"  # noqa: E731
    problems, warnings = [], []  # the trainer's first: more GPUs, where needed, is the fix that matters most
    more = None if low <= high else _more_gpus(cfg, world, gpu_bytes, arch, z, T)
    for phase in ("start-up", "rollout") if hf else ():
        if peak(ph[phase]) > gpu_bytes:
            fix = "lower rollout.hf_max_batch" if phase == "rollout" else "use more GPUs"
            problems.append(f"{phase}: needs {gib(peak(ph[phase]))} of {gib(gpu_bytes)} (hf backend): {fix}")
    for phase, what in () if hf else (("start-up", "at engine build"), ("rollout", "during rollouts")):
        if peak(ph[phase]) > gpu_bytes:
            trainer, vllm = peak(ph[phase]) - _vllm(ph[phase]).bytes, _vllm(ph[phase]).bytes
            fix = more or f"lower rollout.gpu_memory_utilization to <= {_down(high):.2f}"
            problems.append(
                f"{phase}: the trainer's {gib(trainer)} {what} + vLLM's {gib(vllm)} exceed {gib(gpu_bytes)}: {fix}"
            )
    if peak(ph["update"]) > gpu_bytes:
        lo, hi = seq, T  # largest micro-batch that fits, if shrinking it helps
        if peak(phases(cfg, world, gpu_bytes, arch, z, util, lo)[0]["update"]) <= gpu_bytes:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                fits = peak(phases(cfg, world, gpu_bytes, arch, z, util, mid)[0]["update"]) <= gpu_bytes
                lo, hi = (mid, hi) if fits else (lo, mid)
            fix = f"lower train.micro_batch_tokens to <= {lo}"
        elif not cfg.model.gradient_checkpointing:
            fix = "set model.gradient_checkpointing=true"
        else:
            fix = more or _more_gpus(cfg, world, gpu_bytes, arch, z, T)
        problems.append(f"update: needs {gib(peak(ph['update']))} of {gib(gpu_bytes)}: {fix}")
    if kv["sequences_held"] < 1 and not hf:
        problems.append(
            f"vLLM: its share ({gib(_vllm(ph['rollout']).bytes)}) leaves no KV cache for one {seq}-token sequence "
            f"beside its weights and profiling: raise rollout.gpu_memory_utilization to >= {_up(low):.2f}"
        )
    if 1 <= kv["sequences_held"] < kv["sequences_needed"] and not hf:
        need = _bounds(ph, kv, gpu_bytes, kv["sequences_needed"])[0]
        fix = (
            f"raise rollout.gpu_memory_utilization to {_up(need):.2f}"
            if need <= high
            else "lower rollout.max_tokens or train.rollout_batch_size, or use more GPUs"
        )
        warnings.append(
            f"KV cache holds {kv['sequences_held']} of the {kv['sequences_needed']} {seq}-token "
            f"sequences each engine starts at once; vLLM queues the rest (slower, not OOM): {fix}"
        )
    return Plan(arch, world, gpu_bytes, T, ph, kv, problems, warnings, choices=choices)
