"""The rollout engine a training run uses, by `rollout.backend` (trapo/engine/rollout.py lists the backends)."""

from __future__ import annotations

from trapo.config import Config


def open_engine(cfg: Config, policy, *, model_dir: str, tokenizer, rank: int, world: int, stop_token_ids: list[int]):
    """This rank's rollout engine for a training run, by `rollout.backend`."""
    r = cfg.rollout
    if r.backend == "hf":
        from trapo.engine.hf_rollout import HfEngine

        return HfEngine(
            policy.model,
            tokenizer,
            stop_token_ids=stop_token_ids,
            max_batch=r.hf_max_batch,
            zero3_engine=policy.engine,
        )
    from trapo.engine.vllm_rollout import VllmEngine

    return VllmEngine.for_run(
        cfg,
        model_dir,
        tokenizer=tokenizer,
        rank=rank,
        world=world,
        hf_overrides=policy.overrides,
        stop_token_ids=stop_token_ids,
    )
