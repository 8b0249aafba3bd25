"""The run's `Config` cut into what each part below the training layer runs: the loss's rules (`loss_spec`),
the auto settings the memory plan decides on this node (`planned`), the policy that runs them (`open_policy`)
and this rank's rollout engine (`engine_settings`). The engine and the math layer take these, or a config
section, never the whole config.

    run = planned(cfg, model_dir, world, say=lines.append)   # a line per choice to `say`
    policy = open_policy(run, model_dir, world, pad_id)
    engine = open_engine(engine_settings(run, rank=rank, world=world, overrides=policy.overrides), ...)
"""

from __future__ import annotations

import contextlib

import torch

from trapo import console
from trapo.algorithm.loss import LossSpec, PolicyLoss
from trapo.config import Config, ConfigError, read_deepspeed_config
from trapo.engine import dist
from trapo.engine.memory_plan import choose
from trapo.engine.model_shapes import model_arch
from trapo.engine.policy import Policy
from trapo.engine.rollout_engine import EngineSettings


def open_policy(cfg: Config, model_dir, world: int, pad_id: int) -> Policy:
    """The policy under DeepSpeed with its loss, built once: the policy calls it, the update reads its rules.
    `cfg`: as `planned` decided its auto settings (gradient checkpointing, persistence, the LM head's chunk)."""
    loss = PolicyLoss(loss_spec(cfg), world, on_gpu=torch.cuda.is_available())
    return Policy(
        model_dir,
        world,
        pad_id,
        model=cfg.model,
        train=cfg.train,
        rollout=cfg.rollout,
        loss=loss,
        checkpointing=cfg.model.gradient_checkpointing,
        seed=cfg.seed,
    )


def planned(cfg: Config, model_dir, world: int, say=console.say) -> Config:
    """`cfg` with its auto settings as the memory plan decides them on this node (`memory_plan.choose`), each
    said in one line (`say`): the smallest GPU of the ranks' (so every rank chooses alike; none on CPU), the
    architecture in `model_dir` (None where the plan cannot read it) and train.deepspeed_config. `world`: the
    training ranks. The run's record keeps the settings as written (auto), so a resume on other GPUs decides
    again."""
    gpu = None
    if torch.cuda.is_available():  # collective: every rank runs this
        gpu = min(dist.all_gather(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory))
    arch = ds_config = None
    if gpu:  # the plan's inputs; on CPU there is no device memory to plan
        ds_config = read_deepspeed_config(cfg.train.deepspeed_config)
        with contextlib.suppress(ConfigError):  # a model the plan cannot read stays None: the lines say so
            arch = model_arch(str(model_dir))
    choices = choose(cfg, world, gpu, arch, ds_config)
    for line in choices.lines():
        say(line)
    return choices.apply(cfg)


def loss_spec(cfg: Config) -> LossSpec:
    """The run's loss, decided once from `cfg.loss`, rollout.max_tokens (L_max), rollout.max_staleness (stale
    rounds need an importance correction: loss.rollout_is unset is truncate) and train.skip_zero_advantage."""
    lo, max_tokens = cfg.loss, cfg.rollout.max_tokens
    gspo = lo.objective == "gspo"  # GSPO clips a sequence ratio near 1: its own small range
    return LossSpec(
        objective=lo.objective,
        clip_eps=lo.gspo_clip_eps if gspo else lo.clip_eps,
        clip_eps_high=lo.gspo_clip_eps_high if gspo else lo.clip_eps_high,
        agg=lo.agg,
        max_tokens=max_tokens,
        entropy_coef=lo.entropy_coef,
        beta=lo.beta,
        advantage_scale=lo.advantage_scale,
        overlong=lo.overlong,
        overlong_buffer=lo.overlong_buffer_tokens(max_tokens),
        overlong_penalty=lo.overlong_penalty,
        rollout_is=lo.rollout_is if lo.rollout_is is not None or not cfg.rollout.max_staleness else "truncate",
        rollout_is_cap=lo.rollout_is_cap,
        rollout_is_lower=lo.rollout_is_lower,
        skip_zero_advantage=cfg.train.skip_zero_advantage,
        entropy_agg=lo.entropy_agg,
        entropy_target=lo.entropy_target,
    )


def engine_settings(cfg: Config, *, rank: int, world: int, overrides: dict) -> EngineSettings:
    """This rank's engine for a training run: sized by `rollout.*`, one seed per engine (the ranks of a
    tensor-parallel group share one), and sampled tokens' log-probs kept (logprob_diff_rollout_vs_policy).
    overrides: the model attributes the run sets over the checkpoint's (`Policy.overrides`)."""
    r = cfg.rollout
    separate = r.placement == "separate"
    # how many engines share a round: the rollout ranks (separate), else the training ranks' groups
    engines = r.ranks if separate else world // r.tensor_parallel_size
    return EngineSettings(
        backend=r.backend,
        dtype=cfg.model.dtype,
        max_model_len=cfg.data.max_prompt_tokens + r.max_tokens,
        seed=cfg.seed + rank // r.tensor_parallel_size,
        overrides=overrides,
        hf_max_batch=r.hf_max_batch,
        hf_decoding=r.hf_decoding,
        vllm=dict(
            tensor_parallel_size=r.tensor_parallel_size,
            gpu_memory_utilization=r.gpu_memory_utilization,
            cpu_kv_cache_gb=r.cpu_kv_cache_gb,
            # a rollout rank's engine has its GPU to itself: nothing to make room for between rounds
            enable_sleep_mode=r.enable_sleep_mode and not separate,
            enable_prefix_caching=r.enable_prefix_caching,
            sampled_logprobs=True,
            # The most sequences an engine runs at once in training: its questions (a tensor-parallel
            # group pools its ranks'; a rollout rank takes at most a ceiling share) x G. Validation queues beyond it.
            max_num_seqs=-(-cfg.train.rollout_batch_size // engines) * r.n,
        ),
    )
