"""Training steps at a real model's shape with random weights (no hub), each phase's time and peak memory beside
the memory plan's: one check of `make gpu-check`, run in a process of its own.

    python -m trapo.commands.gpu_check.shape_step --work DIR [--dry-run] [--lora] [--profile | --model-only]
        [--decodings eager,static,cuda_graph,compile] [--steps 2] [--checkpointing true|false|auto]

The model is a DeepSeek-R1-Distill-Qwen-1.5B-shaped Qwen2, the questions and tokenizer the toy's;
rollout.backend=hf with 512-token answers (random weights rarely stop early), 64 questions x 8, bf16, ZeRO-3,
gradient checkpointing (--checkpointing auto: the plan's choice) (--dry-run: the toy's shape, 16 questions x 8
answers of 32 tokens, fp32). Two steps: the second has Adam moments, as the plan's rollout and update phases
assume. Every answer is trained (mode naive_semi gates none out, and train.skip_zero_advantage=false keeps the
zero advantages random weights earn), so the update is measured at its largest. --lora: Qwen2.5-Math-7B's
shape with the adapters and the DeepSpeed config (ZeRO-2) of configs/trapo_1k_3k_lora_1gpu.yaml, read from
that file, as it trains on one GPU.
--profile (`make gpu-bench`): the first step's update under torch.profiler (the same kernels as the second's,
whose figures are reported without the profiler's overhead; its optimizer step also allocates Adam's moments),
then one decode stretch (the round's rows, DECODE_STRETCH tokens each, forced) under it too: their summaries
(gpu_check/profile.py) and the stretch's tokens/s. --decodings: after the steps, the round's rows decoded by
each named rollout.hf_decoding path, VARIANT_TOKENS forced tokens each (gpu_check/decode_variants.py);
--steps 0 decodes without training. --model-only (gpu-bench's trl_step, when no shape step left its model): the
random model and the toy's questions alone, their paths. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import time
from pathlib import Path

from trapo.engine.model_shapes import BUILTIN, Arch

ANSWERS = 8  # per question
DECODE_STRETCH = 32  # tokens per row of the profiled decode stretch: enough steps to average, few events
VARIANT_TOKENS = 128  # forced tokens per row of each decode path's measure: two spans of the cache past the prompt


def hf_shape(arch: Arch) -> dict:
    """A Qwen2Config's widths for a built-in architecture of the memory plan (one table of widths for both)."""
    return dict(
        hidden_size=arch.hidden,
        intermediate_size=arch.intermediate,
        num_hidden_layers=arch.layers,
        num_attention_heads=arch.heads,
        num_key_value_heads=arch.kv_heads,
        vocab_size=arch.vocab,
        max_position_embeddings=16384,
        tie_word_embeddings=arch.tied,
        rope_theta=10000.0,
    )


R1_DISTILL_1P5B = hf_shape(BUILTIN["DeepSeek-R1-Distill-Qwen-1.5B"])
QWEN_MATH_7B = hf_shape(BUILTIN["Qwen2.5-Math-7B"])  # the LoRA step: the paper's model on one GPU
LORA_CONFIG = "configs/trapo_1k_3k_lora_1gpu.yaml"  # the one-GPU LoRA recipe whose adapters and ZeRO stage --lora runs


def lora_overrides() -> list[str]:
    """LORA_CONFIG's adapters and DeepSpeed config, as overrides of the shape step's own settings."""
    from trapo import runtime
    from trapo.config import load_config

    cfg = load_config(str(runtime.ROOT / LORA_CONFIG), [])
    lora = cfg.model.lora
    targets = ",".join(lora.target_modules)
    return [
        f"model.lora.rank={lora.rank}",
        f"model.lora.alpha={lora.alpha}",
        f"model.lora.dropout={lora.dropout}",
        f"model.lora.target_modules=[{targets}]",
        f"train.deepspeed_config={cfg.train.deepspeed_config}",
    ]


def build_model(work: Path, dry_run: bool, shape: dict = R1_DISTILL_1P5B) -> tuple[Path, Path]:
    """(model dir with the toy's tokenizer, the toy's training file)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from trapo.commands.toy import MODEL_SHAPE, build_assets
    from trapo.config import ToyConfig

    toy = build_assets(ToyConfig(dir=str(work / "toy"), sft_steps=50))
    tokenizer = AutoTokenizer.from_pretrained(toy / "model")
    shape = dict(vocab_size=320, **MODEL_SHAPE) if dry_run else shape
    model_dir = work / "model"
    torch.manual_seed(0)
    config = Qwen2Config(**shape, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # random init on the GPU: seconds
        Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir, toy / "train.jsonl"


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@contextlib.contextmanager
def profiling(on: bool, profiles: dict):
    """The step's update phase under torch.profiler (`profiles["update"]`), through the step timer's hook."""
    from trapo.commands.gpu_check.profile import profiled
    from trapo.training.metrics import StepTimer

    if on:
        StepTimer.watch = lambda name: (
            profiled(name, profiles, device()) if name == "update" else contextlib.nullcontext()
        )
    try:
        yield
    finally:
        StepTimer.watch = None


def decode_stretch(trainer, questions: int, profiles: dict) -> float:
    """One decode stretch under torch.profiler (`profiles["decode"]`): the round's rows (questions x ANSWERS),
    DECODE_STRETCH tokens each (forced), in generation's turn after the same stretch unprofiled (captures made);
    its response tokens per second."""
    from trapo.commands.gpu_check.profile import profiled

    source = trainer.rollouts
    prompts = source.prompts[:questions]
    tokens = DECODE_STRETCH

    def stretch():
        seeds = list(range(len(prompts)))
        source.engine.generate(prompts, n=ANSWERS, temperature=1.0, max_tokens=tokens, min_tokens=tokens, seeds=seeds)

    with source.turn():
        stretch()  # a captured decode path captures its shapes here, outside the profile
        with profiled("decode", profiles, device()):
            stretch()
    return round(len(prompts) * ANSWERS * tokens / profiles["decode"]["wall_s"], 1)


def main(argv: list[str] | None = None) -> int:
    from trapo import runtime

    runtime.configure()
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--lora", action="store_true", help="Qwen2.5-Math-7B's shape with rank-32 adapters")
    parser.add_argument("--profile", action="store_true", help="profile the second update and a decode stretch")
    parser.add_argument("--decodings", default="", help="decode paths to measure after the steps (comma-separated)")
    parser.add_argument("--steps", type=int, default=2, help="training steps before (0: only decode)")
    parser.add_argument(
        "--checkpointing", default="true", choices=["true", "false", "auto"], help="model.gradient_checkpointing"
    )
    parser.add_argument("--model-only", action="store_true", help="build the model, print its and the data's paths")
    args = parser.parse_args(argv)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    import torch

    from trapo.config import load_config
    from trapo.engine.memory_plan import memory_plan
    from trapo.engine.model_shapes import model_arch
    from trapo.training.trainer import Trainer

    started = time.perf_counter()
    model_dir, train_file = build_model(work, args.dry_run, QWEN_MATH_7B if args.lora else R1_DISTILL_1P5B)
    build_s = time.perf_counter() - started
    if args.model_only:
        print(
            json.dumps({"model_dir": str(model_dir), "train_file": str(train_file), "model_build_s": round(build_s, 1)})
        )
        return 0
    # One rollout batch per step; the dry run only proves the script runs, in a quarter of the work.
    questions, answer = (16, 32) if args.dry_run else (64, 512)
    answers = questions * ANSWERS
    overrides = [
        "toy.enabled=false",
        f"model.path={model_dir}",
        f"data.train_files=[{train_file}]",
        "data.test_files=[]",
        f"model.dtype={'float32' if args.dry_run else 'bfloat16'}",  # bf16 on GPU; CPU trains in fp32
        f"model.gradient_checkpointing={args.checkpointing}",
        "rollout.backend=hf",
        f"rollout.n={ANSWERS}",
        f"rollout.max_tokens={answer}",
        f"train.rollout_batch_size={questions}",
        f"train.update_batch_size={questions}",
        "train.micro_batch_tokens=16384",
        "max_steps=2",
        "save_steps=0",
        f"output_dir={work / 'runs'}",
        "run_name=shape-step",
        "progress_bar=false",
        "eval.steps=0",
        # Every answer in the update, its largest size at this shape: random weights earn every answer the
        # same reward (zero advantage, skipped by default), and naive_semi gates no unlabeled answer out.
        "train.skip_zero_advantage=false",
        "mode=naive_semi",
        *(lora_overrides() if args.lora else []),
    ]
    cfg = load_config(str(runtime.ROOT / "configs" / "toy.yaml"), overrides)
    trainer = Trainer(cfg)
    profiles: dict = {}
    decodings: dict = {}
    try:
        # --profile: the first step's update (the second, measured, runs without the profiler's overhead)
        with profiling(args.profile, profiles):
            logs = [trainer.train_step() for _ in range(min(args.steps, 1))]
        logs += [trainer.train_step() for _ in range(args.steps - 1)]
        if args.profile:
            profiles["decode_tokens_per_s"] = decode_stretch(trainer, questions, profiles)
        if args.decodings:
            from trapo.commands.gpu_check import decode_variants

            source = trainer.rollouts
            tokens = DECODE_STRETCH if args.dry_run else VARIANT_TOKENS
            names = args.decodings.split(",")
            decodings = decode_variants.measure(source.engine, source.prompts[:questions], ANSWERS, tokens, names)
    finally:
        trainer.close()
    params = list(trainer.policy.model.parameters())
    result = {
        "model_build_s": round(build_s, 1),
        "model_dir": str(model_dir),  # gpu-bench's trl_step trains the same model on the same questions
        "train_file": str(train_file),
        "decodings": decodings,
        "decoding": trainer.rollouts.engine.decoding,
        "checkpointing": next((line for line in trainer.chosen if line.startswith("gradient checkpointing")), None),
    }
    if not logs:
        print(json.dumps(result))
        return 0
    last = logs[-1]
    result |= {
        "params": sum(getattr(p, "ds_numel", p.numel()) for p in params),
        "trainable": sum(getattr(p, "ds_numel", p.numel()) for p in params if p.requires_grad),
        "mean_response_tokens": last["response_tokens"] / answers if "response_tokens" in last else None,
        "timing_s": last["timing"],
        "peak_gib": last.get("peak_gb"),
        "answers": answers,
        "trained_sequences": last["trained_sequences"],
        "logprob_diff_rollout_vs_policy": last["logprob_diff_rollout_vs_policy"],
        "zero_stage": trainer.policy.engine.zero_optimization_stage(),
        **({"profile": profiles} if args.profile else {}),
    }
    if torch.cuda.is_available():
        ds_config = json.loads(Path(cfg.train.deepspeed_config).read_text())
        total = torch.cuda.get_device_properties(0).total_memory
        plan = memory_plan(cfg, 1, total, model_arch(str(model_dir)), ds_config)
        result["plan_gib"] = {phase: round(plan.peak(phase) / 2**30, 2) for phase in plan.phases}
        result["plan_fits"] = plan.fits
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    from trapo import console

    console.exit_now(main())
