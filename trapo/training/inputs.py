"""A run's inputs, checked before any model loads: the model directory, the training questions and their
prompt tokens, the held-out and validation benchmarks, and the batch counts.

    inputs = prepare_inputs(cfg, world, model_dir)   # no collective; the toy's assets are built beforehand,
                                                     # a hub model fetched (model_dir: its local snapshot)

Every input error (a missing model directory, a bad training or benchmark file, a prompt longer than
data.max_prompt_tokens, a prompt and response budget past the model's context, batch sizes that do not
divide over the ranks) is raised here, naming the file, row or key, before the policy, the reference model
or vLLM cost anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trapo import console, hub
from trapo.config import Config, ConfigError
from trapo.data import (
    Benchmark,
    DataError,
    Question,
    epoch_batches,
    gradable,
    load_questions,
    read_benchmark_file,
    select_for_mode,
    tokenize_prompts,
)
from trapo.engine import dist
from trapo.engine.rollout import context_limit


@dataclass
class RunInputs:
    model_dir: str
    questions: list[Question]  # [Q] the mode's training questions
    prompts: list[list[int]]  # [Q] prompt token ids
    tokenizer: Any  # the model's tokenizer, with a pad token
    test_benchmarks: list[Benchmark]  # data.test_files: held-out pass@1 before and after training
    val_benchmarks: list[Benchmark]  # eval.files (the toy: its validation or test splits): checkpoint selection
    steps_per_epoch: int  # batches in one epoch's order
    total_steps: int  # max_steps, or epochs x steps_per_epoch (an upper bound when refills consume batches)


def fetch_model(cfg: Config) -> hub.Snapshot | None:
    """model.path as a local directory (None for the toy): a hub id is downloaded once per node (local rank 0
    first; HF_HUB_OFFLINE: the cache alone) and its resolved commit kept, so that a resume can tell when the
    revision moved. Collective: every rank calls it."""
    if cfg.toy.enabled:
        return None
    m = cfg.model
    snap = dist.once_per_node(lambda cached_only: hub.fetch(m.path, m.revision, cached_only=cached_only))
    if snap.commit:
        console.say(f"model.path {m.path}: hub commit {snap.commit} ({m.revision or 'default branch'})")
    return snap


def check_context(cfg: Config, limit: tuple[int, str] | None, what: str) -> None:
    """data.max_prompt_tokens + rollout.max_tokens (the engine's max_model_len) against `limit`, the context
    (tokens, config key) that trapo.engine.rollout.context_limit reads for `what` (model.path, the toy
    model): a ConfigError naming the keys and the fix, before any model loads."""
    prompt, response = cfg.data.max_prompt_tokens, cfg.rollout.max_tokens
    if limit is None or prompt + response <= limit[0]:
        return
    tokens, key = limit
    overridden = cfg.model.max_position_embeddings is not None and key.startswith("max_position_embeddings")
    source = f"model.{key} = {tokens}" if overridden else f"{key} = {tokens} in its config.json"
    room = tokens - prompt
    lower = f"lower rollout.max_tokens to {room} or less" if room > 0 else "lower data.max_prompt_tokens"
    raise ConfigError(
        f"data.max_prompt_tokens + rollout.max_tokens = {prompt + response} tokens exceeds what {what} serves "
        f"({source}; vLLM refuses a longer max_model_len): {lower}, or set model.max_position_embeddings "
        "(with model.rope_theta, as the paper does for Qwen2.5-Math)"
    )


def check_hidden_golds(cfg: Config, questions: list, files: list[str]) -> None:
    """labels.budget buys the golds unlabeled rows hold back: none to buy is the data to fix, before any load;
    fewer than the budget is said."""
    budget = cfg.labels.budget
    if not budget:
        return
    held = sum(not q.labeled and q.answer is not None for q in questions)
    if held == 0:
        raise DataError(
            f"labels.budget {budget}: no unlabeled row of {', '.join(files)} holds a gold answer to reveal; "
            "give the unlabeled rows their `answer` (kept from the reward until bought) or set labels.budget=0"
        )
    if held < budget:
        console.say(f"labels.budget {budget}: only {held} unlabeled questions hold a gold; at most {held} are bought")


def prepare_inputs(cfg: Config, world: int, model_dir: str | None = None) -> RunInputs:
    if cfg.toy.enabled:
        root = cfg.toy.asset_dir
        if not (root / "manifest.json").is_file():  # built by the entry point (trapo.commands.toy.prepare)
            raise ConfigError(
                f"toy.enabled: no toy model and data in {root}; `python -m trapo train` builds them "
                "(in code: trapo.commands.toy.prepare(cfg) before the Trainer)"
            )
        model_dir = str(root / "model")
        train_files = [str(root / "train.jsonl")]
        test_files = [str(p) for p in (root / "test.jsonl", root / "test_ood.jsonl") if p.is_file()]
        toy_val = [str(root / "validation.jsonl")] if cfg.toy.validation else test_files
        what = "the toy model"
    else:
        model_dir = model_dir or cfg.model.path
        train_files, test_files, toy_val = cfg.data.train_files, cfg.data.test_files, []
        if not (Path(model_dir) / "config.json").is_file():
            raise ConfigError(f"model.path {model_dir}: not a Hugging Face model directory (no config.json)")
        problem = hub.weight_problem(model_dir)
        if problem:
            raise ConfigError(f"model.path {cfg.model.path}: {problem}")
        what = "model.path"
    check_context(cfg, context_limit(model_dir, cfg.model.max_position_embeddings), what)
    t = cfg.train
    if t.rollout_batch_size % world or t.update_batch_size % world:
        raise ConfigError(
            f"train.rollout_batch_size ({t.rollout_batch_size}) and train.update_batch_size "
            f"({t.update_batch_size}) must be multiples of the world size ({world})"
        )
    questions = select_for_mode(load_questions(train_files, cfg.data.labeled_ratio, cfg.seed), cfg.mode)
    questions, dropped = gradable(questions, cfg.data.drop_ungradable_golds, math=cfg.reward.verifier == "math")
    if dropped:
        console.say(f"data.drop_ungradable_golds: dropped {dropped} labeled rows whose gold is empty or prose")
    check_hidden_golds(cfg, questions, train_files)
    test_benchmarks = [b for f in test_files for b in read_benchmark_file(Path(f))]
    val_files = cfg.eval.files or toy_val  # the toy: its validation split, or without one its test splits
    val_benchmarks = [b for f in val_files for b in read_benchmark_file(Path(f))]
    names = [b.name for b in val_benchmarks]
    if cfg.eval.select_on is not None and cfg.eval.select_on not in names:
        raise ConfigError(f"eval.select_on: '{cfg.eval.select_on}' is not a validation benchmark; have {names}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    d = cfg.data
    prompts = tokenize_prompts(questions, d.prompt_template, tokenizer, d.max_prompt_tokens)
    for bench in test_benchmarks + val_benchmarks:  # prompt lengths checked now, not mid-run
        tokenize_prompts(bench.questions, d.prompt_template, tokenizer, d.max_prompt_tokens)
    steps_per_epoch = len(epoch_batches(len(questions), t.rollout_batch_size, t.update_batch_size, 0, 0))
    if steps_per_epoch == 0:
        raise DataError(f"{len(questions)} training questions: too few for one batch on {world} ranks")
    return RunInputs(
        model_dir=model_dir,
        questions=questions,
        prompts=prompts,
        tokenizer=tokenizer,
        test_benchmarks=test_benchmarks,
        val_benchmarks=val_benchmarks,
        steps_per_epoch=steps_per_epoch,
        total_steps=cfg.max_steps or cfg.epochs * steps_per_epoch,
    )
