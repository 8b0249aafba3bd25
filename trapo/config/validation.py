"""Cross-key checks of a loaded configuration: ranges and combinations that a type alone cannot express."""

from __future__ import annotations

import dataclasses

from trapo.config.choices import verifier_problem
from trapo.config.schema import Config, ConfigError, flatten


def validate(cfg: Config, source: str = "config", origins: dict[str, str] | None = None) -> None:
    """Cross-key checks that a type alone cannot express. `origins` maps the keys a command-line override set
    to that override, which an error then names instead of the file."""
    origins = origins or {}

    def need(ok: bool, key: str, msg: str) -> None:
        if not ok:
            raise ConfigError(f"{origins.get(key, source)}: key '{key}': {msg}")

    need(
        bool(cfg.run_name.strip()) and not any(c in cfg.run_name for c in "/\\") and cfg.run_name not in (".", ".."),
        "run_name",
        f"must be a plain directory name (no '/', not '.' or '..'), got {cfg.run_name!r}",
    )
    known = flatten(dataclasses.asdict(cfg))
    for key in cfg.resume_changes:
        need(key in known, "resume_changes", f"{key!r} is not a setting (a dotted key such as rollout.n)")
    need(cfg.epochs >= 1, "epochs", f"must be >= 1, got {cfg.epochs}")
    need(cfg.max_steps is None or cfg.max_steps >= 1, "max_steps", f"must be >= 1 or null, got {cfg.max_steps}")
    need(cfg.save_steps >= 0, "save_steps", f"must be >= 0, got {cfg.save_steps}")
    need(cfg.dist_timeout_minutes > 0, "dist_timeout_minutes", f"must be > 0, got {cfg.dist_timeout_minutes}")
    need(cfg.keep_checkpoints is None or cfg.keep_checkpoints >= 1, "keep_checkpoints", "must be >= 1 or null")
    r, t, s = cfg.rollout, cfg.train, cfg.selection
    need(
        r.hf_max_batch == "auto" or r.hf_max_batch >= 1,
        "rollout.hf_max_batch",
        f"must be >= 1 or auto, got {r.hf_max_batch}",
    )
    need(
        not (r.backend == "hf" and cfg.train.offload_during_rollout),
        "train.offload_during_rollout",
        "the hf backend generates with the policy's own partitions, so they cannot move to host memory; "
        "leave it unset (null) or false",
    )
    need(
        not (r.backend == "hf" and r.tensor_parallel_size != 1),
        "rollout.tensor_parallel_size",
        "the hf backend generates on each rank alone (ZeRO-3 gathers the whole model there); set it to 1",
    )
    need(r.n >= 2, "rollout.n", f"GRPO needs at least 2 rollouts per question, got {r.n}")
    # The sampling ranges below are vLLM 0.32's (SamplingParams._verify_args): temperature in [0, 2],
    # top_p in (0, 1], max_tokens >= 1, n == 1 under greedy decoding; the hf backend keeps the same ranges.
    need(0 < r.temperature <= 2, "rollout.temperature", f"must be in (0, 2] for sampling, got {r.temperature}")
    need(0 <= r.eval_temperature <= 2, "rollout.eval_temperature", f"must be in [0, 2], got {r.eval_temperature}")
    need(0 < r.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {r.top_p}")
    need(r.max_tokens >= 1, "rollout.max_tokens", f"must be >= 1, got {r.max_tokens}")
    need(
        0 <= r.min_tokens <= r.max_tokens,
        "rollout.min_tokens",
        f"must be in [0, rollout.max_tokens={r.max_tokens}], got {r.min_tokens}",
    )
    need(0 < r.gpu_memory_utilization < 1, "rollout.gpu_memory_utilization", "must be in (0, 1)")
    need(
        r.dynamic_sampling_max_rounds >= 0,
        "rollout.dynamic_sampling_max_rounds",
        f"must be >= 0 (0: no limit), got {r.dynamic_sampling_max_rounds}",
    )
    lo = cfg.model.lora
    need(lo.rank >= 0, "model.lora.rank", f"must be >= 0 (0: full fine-tuning), got {lo.rank}")
    if lo.rank:
        need(lo.alpha > 0, "model.lora.alpha", f"must be > 0, got {lo.alpha}")
        need(0 <= lo.dropout < 1, "model.lora.dropout", f"must be in [0, 1), got {lo.dropout}")
        need(bool(lo.target_modules), "model.lora.target_modules", "must name a module, e.g. [q_proj, v_proj]")
    h = r.health
    need(h.warn is None or h.warn > 0, "rollout.health.warn", f"must be > 0 or null, got {h.warn}")
    need(h.stop is None or h.stop > 0, "rollout.health.stop", f"must be > 0 or null, got {h.stop}")
    need(
        h.warn is None or h.stop is None or h.warn <= h.stop,
        "rollout.health.warn",
        f"must not exceed rollout.health.stop ({h.stop}), got {h.warn}",
    )
    need(h.steps >= 1, "rollout.health.steps", f"must be >= 1, got {h.steps}")
    g = r.rambling
    key = "rollout.rambling."
    need(g.truncated is None or 0 < g.truncated <= 1, key + "truncated", f"must be in (0, 1] or null: {g.truncated}")
    need(g.entropy_factor > 1, key + "entropy_factor", f"must be > 1, got {g.entropy_factor}")
    need(
        g.loop_truncated is None or 0 < g.loop_truncated <= 1,
        key + "loop_truncated",
        f"must be in (0, 1] or null: {g.loop_truncated}",
    )
    need(g.loop_steps >= 1, key + "loop_steps", f"must be >= 1, got {g.loop_steps}")
    need(g.stop_steps is None or g.stop_steps >= 1, key + "stop_steps", f"must be >= 1 or null, got {g.stop_steps}")
    need(r.tensor_parallel_size >= 1, "rollout.tensor_parallel_size", f"must be >= 1, got {r.tensor_parallel_size}")
    _placement(cfg, need)
    need(t.rollout_batch_size >= 1, "train.rollout_batch_size", "must be >= 1")
    need(
        t.update_batch_size >= 1 and t.rollout_batch_size % t.update_batch_size == 0,
        "train.update_batch_size",
        f"must divide train.rollout_batch_size ({t.rollout_batch_size}), got {t.update_batch_size}",
    )
    need(t.lr > 0, "train.lr", f"must be > 0, got {t.lr}")
    need(len(t.adam_betas) == 2, "train.adam_betas", f"must be [beta1, beta2], got {t.adam_betas}")
    need(t.micro_batch_tokens >= 1, "train.micro_batch_tokens", "must be >= 1")
    need(t.update_threads is None or t.update_threads >= 1, "train.update_threads", "must be >= 1, or null")
    need(t.loss_chunk_tokens == "auto" or t.loss_chunk_tokens >= 1, "train.loss_chunk_tokens", "must be >= 1 or auto")
    lo = cfg.loss
    need(lo.rollout_is_cap > 0, "loss.rollout_is_cap", f"must be > 0, got {lo.rollout_is_cap}")
    if lo.rollout_is_lower is not None:
        need(
            lo.rollout_is in ("token_mask", "sequence_mask"),
            "loss.rollout_is_lower",
            f"only the mask modes use a lower bound; loss.rollout_is is {lo.rollout_is!r}",
        )
        need(
            0 <= lo.rollout_is_lower < lo.rollout_is_cap,
            "loss.rollout_is_lower",
            f"must be in [0, loss.rollout_is_cap={lo.rollout_is_cap}), got {lo.rollout_is_lower}",
        )
    need(lo.entropy_coef >= 0, "loss.entropy_coef", f"must be >= 0, got {lo.entropy_coef}")
    if lo.entropy_target is not None:
        need(lo.entropy_target > 0, "loss.entropy_target", f"must be > 0 (nats) or null, got {lo.entropy_target}")
        need(lo.entropy_coef_step > 0, "loss.entropy_coef_step", f"must be > 0, got {lo.entropy_coef_step}")
        need(
            lo.entropy_coef <= lo.entropy_coef_max,
            "loss.entropy_coef",
            f"the adaptive coefficient starts there: must be <= loss.entropy_coef_max ({lo.entropy_coef_max})",
        )
    need(lo.gspo_clip_eps > 0, "loss.gspo_clip_eps", f"must be > 0, got {lo.gspo_clip_eps}")
    need(lo.gspo_clip_eps_high > 0, "loss.gspo_clip_eps_high", f"must be > 0, got {lo.gspo_clip_eps_high}")
    need(lo.clip_eps_high is None or lo.clip_eps_high > 0, "loss.clip_eps_high", "must be > 0 or null")
    if lo.overlong == "soft_penalty":
        buffer = lo.overlong_buffer_tokens(r.max_tokens)
        need(
            0 < buffer < r.max_tokens,
            "loss.overlong_buffer",
            f"must be in [1, rollout.max_tokens={r.max_tokens}) for soft_penalty, got {buffer}",
        )
        need(lo.overlong_penalty > 0, "loss.overlong_penalty", f"must be > 0, got {lo.overlong_penalty}")
    else:
        need(lo.overlong_buffer is None, "loss.overlong_buffer", "only loss.overlong=soft_penalty uses it")
    need(t.max_bad_steps >= 1, "train.max_bad_steps", "must be >= 1")
    need(cfg.loss.clip_eps > 0, "loss.clip_eps", "must be > 0")
    need(cfg.loss.beta >= 0.0, "loss.beta", f"must be >= 0, got {cfg.loss.beta}")
    for key, problem in s.problems():
        need(False, key, problem)
    c = cfg.sampling
    need(
        c.curriculum_window >= 1,
        "sampling.curriculum_window",
        f"must be >= 1 (recorded pass rates that must all be 1 or all 0), got {c.curriculum_window}",
    )
    need(
        c.curriculum_readmit_every >= 2,
        "sampling.curriculum_readmit_every",
        f"must be >= 2 (1 would never skip: every epoch would re-admit), got {c.curriculum_readmit_every}",
    )
    need(
        cfg.data.labeled_ratio is None or 0 <= cfg.data.labeled_ratio <= 1,
        "data.labeled_ratio",
        "must be in [0, 1] or null",
    )
    need(cfg.reward.timeout > 0, "reward.timeout", "must be > 0")
    need(verifier_problem(cfg.reward.verifier) is None, "reward.verifier", verifier_problem(cfg.reward.verifier))
    budget = cfg.reward.step_budget
    need(budget is None or budget > 0, "reward.step_budget", f"must be > 0 or null, got {budget}")
    for name in ("positive", "margin", "rare"):
        value = getattr(cfg.reward.scrl, name)
        need(0 <= value <= 1, f"reward.scrl.{name}", f"must be a share of the group, in [0, 1], got {value}")
    lab = cfg.labels
    need(lab.budget >= 0, "labels.budget", f"must be >= 0 (0: no labels bought), got {lab.budget}")
    need(lab.per_epoch is None or lab.per_epoch >= 1, "labels.per_epoch", f"must be >= 1 or null, got {lab.per_epoch}")
    need(
        not lab.budget or cfg.mode != "supervised",
        "labels.budget",
        "buys labels for unlabeled questions, which mode supervised never trains on: "
        "set labels.budget=0 or another mode",
    )
    need(cfg.eval.steps >= 0, "eval.steps", f"must be >= 0, got {cfg.eval.steps}")
    need(
        not cfg.eval.steps or bool(cfg.eval.files) or cfg.toy.enabled,
        "eval.files",
        "eval.steps > 0 needs validation files",
    )
    e = cfg.eval
    need(e.n >= 1, "eval.n", f"must be >= 1, got {e.n}")
    need(0 <= e.temperature <= 2, "eval.temperature", f"must be in [0, 2], got {e.temperature}")
    need(e.temperature > 0 or e.n == 1, "eval.n", f"greedy decoding (eval.temperature 0) draws one sample, got {e.n}")
    need(e.heldout_k >= 0, "eval.heldout_k", f"must be >= 0 (0: greedy held-out accuracy only), got {e.heldout_k}")
    need(
        e.temperature > 0 or e.heldout_k == 0,
        "eval.heldout_k",
        f"avg@{e.heldout_k} samples at eval.temperature, which is 0 (greedy): set eval.temperature > 0 or heldout_k 0",
    )
    need(
        e.max_tokens is None or 1 <= e.max_tokens <= r.max_tokens,
        "eval.max_tokens",
        f"must be in [1, rollout.max_tokens={r.max_tokens}] (the engine is sized for rollout.max_tokens), "
        f"or null, got {e.max_tokens}",
    )
    need(cfg.data.max_prompt_tokens >= 1, "data.max_prompt_tokens", f"must be >= 1, got {cfg.data.max_prompt_tokens}")
    # torch.optim.AdamW's own checks (weight_decay >= 0, each beta in [0, 1))
    need(t.weight_decay >= 0, "train.weight_decay", f"must be >= 0, got {t.weight_decay}")
    need(all(0 <= b < 1 for b in t.adam_betas), "train.adam_betas", f"each must be in [0, 1), got {t.adam_betas}")
    need(r.cpu_kv_cache_gb > 0, "rollout.cpu_kv_cache_gb", f"must be > 0, got {r.cpu_kv_cache_gb}")
    m = cfg.model
    need(m.rope_theta is None or m.rope_theta > 0, "model.rope_theta", f"must be > 0 or null, got {m.rope_theta}")
    need(
        m.max_position_embeddings is None or m.max_position_embeddings >= 1,
        "model.max_position_embeddings",
        f"must be >= 1 or null, got {m.max_position_embeddings}",
    )
    need(cfg.reward.workers >= 1, "reward.workers", "must be >= 1")
    lg = cfg.logging
    need(lg.rollouts_every >= 0, "logging.rollouts_every", f"must be >= 0 (0: no dumps), got {lg.rollouts_every}")
    if lg.wandb.enabled:
        need(bool(lg.wandb.project.strip()), "logging.wandb.project", "must be a non-empty project name")
        need(
            lg.wandb.run_name is None or bool(lg.wandb.run_name.strip()),
            "logging.wandb.run_name",
            "must be a name or null",
        )
        need(
            all(t.strip() and len(t) <= 64 for t in lg.wandb.tags),
            "logging.wandb.tags",
            "wandb takes tags of 1-64 characters",
        )
    if lg.mlflow.enabled:
        need(bool(lg.mlflow.experiment.strip()), "logging.mlflow.experiment", "must be a non-empty experiment name")
        need(
            lg.mlflow.run_name is None or bool(lg.mlflow.run_name.strip()),
            "logging.mlflow.run_name",
            "must be a name or null",
        )
        uri = lg.mlflow.tracking_uri
        need(
            uri is None or bool(uri.strip()), "logging.mlflow.tracking_uri", "must be a URI, or null for run_dir/mlruns"
        )
    need(cfg.toy.sft_lr > 0, "toy.sft_lr", f"must be > 0 (the warm start's learning rate), got {cfg.toy.sft_lr}")
    noise = cfg.toy.sft_noise
    need(0 <= noise < 1, "toy.sft_noise", f"must be in [0, 1) (a share of the warm start's answers), got {noise}")
    need(
        noise == 0 or cfg.toy.task == "addition",
        "toy.sft_noise",
        f"the teacher's slips (a+b+10) need task 'addition', got task '{cfg.toy.task}': set toy.sft_noise=0",
    )
    if cfg.toy.enabled:
        need(not cfg.model.path, "model.path", "must be empty when toy.enabled (the toy builds its own model)")
        need(not cfg.data.train_files, "data.train_files", "must be empty when toy.enabled")
    else:
        need(bool(cfg.model.path), "model.path", "a Hugging Face model directory or hub id is required")
        need(bool(cfg.data.train_files), "data.train_files", "at least one parquet or JSONL file is required")
    revision = cfg.model.revision
    need(
        revision is None or (bool(revision.strip()) and not cfg.toy.enabled),
        "model.revision",
        "a branch, tag or commit of the hub repository model.path names; null for its default branch "
        "(and with toy.enabled)",
    )


def _placement(cfg: Config, need) -> None:
    """rollout.placement, rollout.ranks and rollout.max_staleness (trapo/engine/rollout_link.py)."""
    r = cfg.rollout
    need(r.ranks >= 1, "rollout.ranks", f"must be >= 1, got {r.ranks}")
    need(r.max_staleness >= 0, "rollout.max_staleness", f"must be >= 0, got {r.max_staleness}")
    if r.placement != "separate":
        need(
            r.max_staleness == 0,
            "rollout.max_staleness",
            f"only rollout.placement=separate generates ahead of the update; got {r.max_staleness} with "
            f"{r.placement}: set rollout.placement=separate or rollout.max_staleness=0",
        )
        return
    need(
        r.tensor_parallel_size == 1,
        "rollout.tensor_parallel_size",
        f"rollout.placement=separate runs one engine per rollout rank (an engine across rollout ranks is not "
        f"built); got {r.tensor_parallel_size}: set rollout.tensor_parallel_size=1",
    )
    if r.max_staleness > 0:
        need(
            cfg.loss.rollout_is not in ("off", False),
            "loss.rollout_is",
            f"rollout.max_staleness={r.max_staleness} trains on rollouts of older weights, which the importance "
            "weight corrects: leave loss.rollout_is unset (truncate) or choose a mode other than off",
        )
        need(
            cfg.sampling.curriculum == "none",
            "sampling.curriculum",
            f"rollout.max_staleness={r.max_staleness} asks for the next epoch's rounds before this epoch ends, when "
            "the curriculum has not yet planned which questions that epoch skips: set sampling.curriculum=none "
            "or rollout.max_staleness=0",
        )
