"""The memory plan against figures worked out by hand, its hints, and `python -m trapo doctor --plan`'s exit codes."""

import json
import os
import subprocess
import sys

import pytest

from trapo.config import ConfigError, load_config
from trapo.engine.memory_plan import GiB, checkpointing_needed, memory_plan
from trapo.engine.model_shapes import BUILTIN, model_arch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "trapo_1k_3k.yaml")


# The figures worked out by hand below take these settings; what auto chooses for them is tested on its own
# (tests/engine/test_plan_choices.py).
PINNED = ["train.loss_chunk_tokens=256", "train.param_persistence=false", "rollout.hf_max_batch=256"]


def plan_for(world, gib, *overrides, config=CONFIG):
    cfg = load_config(config, [*PINNED, *overrides])
    with open(os.path.join(ROOT, cfg.train.deepspeed_config)) as f:
        ds = json.load(f)
    return memory_plan(cfg, world, gib * GiB, model_arch(cfg.model.path), ds)


def figures(plan, phase):
    return {i.name: (i.bytes, i.counted) for i in plan.phases[phase]}


def test_parameter_counts_of_the_built_in_models():
    # Qwen2.5-Math-7B, per layer: q, o 3584^2 = 12,845,056 each; k, v 3584 x 512 = 1,835,008 each;
    # q/k/v biases 3584 + 512 + 512 = 4,608 -> attention 29,364,736; MLP 3 x 3584 x 18944 = 203,685,888;
    # two norms 7,168 -> 233,057,792; x 28 = 6,525,618,176; + embeddings and head 2 x 152064 x 3584
    # = 1,089,994,752 + final norm 3,584 = 7,615,616,512.
    assert BUILTIN["Qwen2.5-Math-7B"].params == 7_615_616_512
    # R1-Distill-Qwen-1.5B: layer 2,360,832 + 786,944 + 2,359,296 + 41,287,680 + 3,072 = 46,797,824; x 28
    # = 1,310,339,072; + 2 x 151936 x 1536 = 466,747,392 + 1,536 = 1,777,088,000 (tied would be 1.54e9).
    assert BUILTIN["DeepSeek-R1-Distill-Qwen-1.5B"].params == 1_777_088_000
    # Llama-3.1-8B: layer 41,943,040 + 176,160,768 + 8,192 = 218,112,000; x 32 + 2 x 128256 x 4096 + 4096.
    assert BUILTIN["Llama-3.1-8B-Instruct"].params == 8_030_261_248


def test_model_arch_from_config_json_table_or_error(tmp_path):
    model = tmp_path / "my-model"
    model.mkdir()
    with pytest.raises(ConfigError, match="no config.json"):  # a directory without config.json
        model_arch(str(model))
    keys = dict(
        model_type="qwen2",
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
        tie_word_embeddings=False,
    )
    (model / "config.json").write_text(json.dumps(keys))
    arch = model_arch(str(model))
    assert (arch.params, arch.head_dim, arch.qkv_bias, arch.source) == (
        1_777_088_000,
        128,
        True,
        str(model / "config.json"),
    )
    assert model_arch("models/Qwen2.5-Math-7B") == BUILTIN["Qwen2.5-Math-7B"]  # absent here: the table
    with pytest.raises(ConfigError, match="no models/Unknown-7B/config.json"):
        model_arch("models/Unknown-7B")


def test_paper_7b_config_on_8_x_80_gib_by_hand():
    plan = plan_for(8, 80)
    # s = P / 8 = 7,615,616,512 / 8 = 951,952,064 parameters per rank.
    # bf16 params 2s = 1,903,904,128; fp32 gradient partition 4s = 3,807,808,256 (grad_accum_dtype fp32);
    # fp32 master 4s = 3,807,808,256; Adam moments 8s = 7,615,616,512; IPG bucket 5e8 x 2 B = 1,000,000,000.
    start = figures(plan, "start-up")
    assert start["param partition (2 B/param / 8)"] == (1_903_904_128, True)
    assert start["gradient partition (4 B/param / 8)"] == (3_807_808_256, True)
    assert start["IPG gradient bucket (500,000,000 x 2 B)"] == (1_000_000_000, True)
    # vLLM asks for ceil(0.6 x 80 GiB) = 51,539,607,552; start-up = 2s + 4s + 4s + 1e9 + reserve 2 GiB
    # (2,147,483,648) + 51,539,607,552 = 64,206,611,840 (59.80 GiB).
    assert plan.peak("start-up") == 64_206_611_840
    # Rollouts: 2s + 4s + IPG (DeepSpeed) and 4s + 8s (Policy.offload) go to the host;
    # 2 GiB + 51,539,607,552 = 53,687,091,200 (50.0 GiB).
    roll = figures(plan, "rollout")
    assert roll["param partition (2 B/param / 8): offloaded"] == (1_903_904_128, False)
    assert roll["Adam moments (8 B/param / 8): offloaded"] == (7_615_616_512, False)
    assert plan.peak("rollout") == 53_687_091_200
    # vLLM: weights 2 x P = 15,231,233,024; profiling peak max(16384 x 2 x (3 x 18944 + 4 x 3584) = 2,332,033,024,
    # 1024 x 152064 x 4 x 3 = 1,868,562,432) = 2,332,033,024; non-torch 1 GiB; KV cache = 51,539,607,552
    # - 15,231,233,024 - 2,332,033,024 - 1,073,741,824 = 32,902,599,680 (30.64 GiB).
    assert roll["  of which KV cache"] == (32_902_599_680, False)
    # 2 (K, V) x 28 layers x 4 kv heads x 128 x 2 B = 57,344 B per token; a 1024 + 8192 = 9216-token sequence
    # 528,482,304 B; 32,902,599,680 // 528,482,304 = 62 held; needed 64 / 8 questions x 8 = 64.
    assert {k: plan.kv[k] for k in ("bytes_per_token", "sequence_bytes", "sequences_held", "sequences_needed")} == {
        "bytes_per_token": 57_344,
        "sequence_bytes": 528_482_304,
        "sequences_held": 62,
        "sequences_needed": 64,
    }
    # Update: 2s + 4s + 4s + 8s + 1e9 = 18,135,137,152; + 2 GiB reserve + 1 GiB vLLM asleep = 21,356,362,624.
    # Gathered 2 x (1e9 + 152064 x 3584) = 3,089,994,752; checkpoints 29 x 16384 x 3584 x 2 = 3,405,774,848;
    # one layer 16384 x 2 x (20 x 3584 + 4 x 512 + 6 x 18944) + 16384 x 28 x 4 = 6,142,296,064, more than the
    # LM head's 4 x 256 x 152064 x 4 + 152064 x 3584 x 6 + 2 x 16384 x 3584 x 2 = 4,127,719,424 and the step's
    # 4s; peak = 21,356,362,624 + 3,089,994,752 + 3,405,774,848 + 6,142,296,064 = 33,994,428,288 (31.66 GiB).
    update = figures(plan, "update")
    assert update["backward: one layer recomputed"] == (6_142_296_064, True)
    assert update["backward: LM head (chunks of 256, [V, H] fp32 grad)"] == (4_127_719_424, False)
    assert update["optimizer step: flattened fp32 gradient"] == (3_807_808_256, False)
    assert plan.peak("update") == 33_994_428_288
    assert plan.fits and plan.problems == []
    # (18,637,007,872 + 64 x 528,482,304) / 80 GiB = 0.6107 -> 0.62 holds all 64.
    (warning,) = plan.warnings
    assert "62 of the 64" in warning and "raise rollout.gpu_memory_utilization to 0.62" in warning
    assert plan_for(8, 141).fits and plan_for(8, 141).kv["sequences_held"] == 136


def test_7b_on_one_24_gib_card_names_the_settings():
    plan = plan_for(1, 24)
    assert not plan.fits
    # The trainer alone holds 10 B/param and the IPG bucket at start-up (~74 GiB): more GPUs; 32 is the next
    # world size dividing the batch sizes at which every phase fits.
    assert plan.problems[0].startswith("start-up:")
    assert "--gpus 32, rollout.gpu_memory_utilization=0.70" in plan.problems[0]
    # vLLM's 0.6 x 24 GiB is less than its weights + profiling + non-torch (17,470,991,360) + one sequence
    # (528,482,304): 17,999,473,664 / 24 GiB = 0.698 -> 0.70.
    assert any("raise rollout.gpu_memory_utilization to >= 0.70" in p for p in plan.problems)


def test_update_hints_name_micro_batch_tokens_and_checkpointing():
    # Peak(T) = 21,356,362,624 + 3,089,994,752 + T x (29 x 3584 x 2 + 2 x 187,392 + 28 x 4 = 582,768) <= 80 GiB:
    # T <= 61,452,988,544 / 582,768 = 105,450.6.
    plan = plan_for(8, 80, "train.micro_batch_tokens=131072")
    assert [p for p in plan.problems if p.startswith("update:")][0].endswith("train.micro_batch_tokens to <= 105450")
    assert plan_for(8, 80, "train.micro_batch_tokens=105450").fits
    plan = plan_for(8, 80, "model.gradient_checkpointing=false")
    assert plan.problems[-1].endswith("set model.gradient_checkpointing=true")


R1_1P5B = os.path.join(ROOT, "configs", "trapo_1k_3k_r1distill_1p5b.yaml")


def test_auto_checkpoints_only_where_the_update_does_not_fit_without_it():
    """auto against the plan's own update peaks with and without checkpointing: on where the update without it
    exceeds the card, off where it fits; the plan then counts what was chosen."""
    chosen = {}
    for config, gib in ((CONFIG, 80), (CONFIG, 141), (R1_1P5B, 80), (R1_1P5B, 141)):
        without = plan_for(8, gib, "model.gradient_checkpointing=false", config=config).peak("update")
        with_it = plan_for(8, gib, "model.gradient_checkpointing=true", config=config).peak("update")
        assert with_it < without  # one layer recomputed instead of every layer's activations
        auto = plan_for(8, gib, "model.gradient_checkpointing=auto", config=config)
        needed = without > gib * GiB
        assert auto.checkpointing[0] is needed, (config, gib, auto.checkpointing)
        assert auto.peak("update") == (with_it if needed else without)
        figure = f"{without / GiB:.1f} of {gib:.1f} GiB without it"
        assert auto.checkpointing[1].endswith(f"{figure}, {with_it / GiB:.1f} with it" if needed else figure)
        chosen[os.path.basename(config), gib] = needed
    assert set(chosen.values()) == {True, False}, chosen  # the shapes above hold each case


def test_checkpointing_needed_at_the_update_peak_obeys_true_and_false_and_is_off_on_cpu():
    cfg = load_config(R1_1P5B, ["model.gradient_checkpointing=auto"])
    with open(os.path.join(ROOT, cfg.train.deepspeed_config)) as f:
        ds = json.load(f)
    arch = model_arch(cfg.model.path)
    without = plan_for(8, 141, "model.gradient_checkpointing=false", config=R1_1P5B).peak("update")
    assert checkpointing_needed(cfg, 8, without, arch, ds)[0] is False  # the update fits exactly
    assert checkpointing_needed(cfg, 8, without - 1, arch, ds)[0] is True  # a byte short
    assert checkpointing_needed(cfg, 8, None, arch, ds) == (False, "auto: no GPU, so no memory plan to fit")
    on, why = checkpointing_needed(cfg, 8, 80 * GiB, None, ds)  # an architecture the plan cannot read
    assert on and "cannot read the model's architecture" in why
    lora = load_config(LORA_1GPU, ["model.gradient_checkpointing=auto", "model.lora.target_modules=[qkv]"])
    on, why = checkpointing_needed(lora, 1, 80 * GiB, arch, ds)  # a run the plan cannot size
    assert on and "cannot size the update" in why and "the plan knows q_proj" in why
    for value, card in ((True, 10**15), (False, 1)):  # explicit: obeyed where the plan would choose otherwise
        fixed = load_config(R1_1P5B, [f"model.gradient_checkpointing={str(value).lower()}"])
        for gpu in (card, None):
            assert checkpointing_needed(fixed, 8, gpu, arch, ds) == (
                value,
                f"model.gradient_checkpointing={str(value).lower()}",
            )


def test_without_offload_the_partitions_stay_during_rollouts():
    # + 2s + 4s + 1e9 = 6,711,712,384 and 4s + 8s = 11,423,424,768 over the offloaded plan.
    assert plan_for(8, 80, "train.offload_during_rollout=false").peak("rollout") == (
        53_687_091_200 + 6_711_712_384 + 11_423_424_768
    )


def test_other_paper_models_fit_on_8_x_80_gib():
    for name in ("trapo_1k_3k_r1distill_1p5b.yaml", "trapo_1k_3k_llama31_8b.yaml"):
        assert plan_for(8, 80, config=os.path.join(ROOT, "configs", name)).fits


def doctor(*args):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "trapo", "doctor", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )


def test_cli_exit_codes():
    ok = doctor("--plan", "--config", "configs/trapo_1k_3k.yaml", "--gpus", "8", "--gpu-memory-gb", "80")
    assert ok.returncode == 0, ok.stderr
    assert "verdict: fits on 8 x 80 GiB" in ok.stdout and "8 x 141 GiB: fits" in ok.stdout
    assert "\ngradient checkpointing: on (model.gradient_checkpointing=true)\n" in ok.stdout  # the config's true
    bad = doctor("--plan", "--config", "configs/trapo_1k_3k.yaml", "--gpus", "1", "--gpu-memory-gb", "24")
    assert bad.returncode == 1 and "does NOT fit" in bad.stdout
    assert bad.stderr.count("\n") == 1 and "--gpus 32" in bad.stderr and "rollout.gpu_memory_utilization" in bad.stderr
    for args in (
        ["--config", "configs/nope.yaml", "--gpus", "8"],
        ["--config", "configs/trapo_1k_3k.yaml", "--gpus", "3"],
        ["--config", "configs/trapo_1k_3k.yaml", "--gpus", "x"],
        ["--config", "configs/toy.yaml", "--gpus", "1"],
    ):
        run = doctor("--plan", *args, "--gpu-memory-gb", "80")
        assert run.returncode == 2 and run.stderr.startswith("trapo doctor: ") and run.stderr.count("\n") == 1, args


def test_hf_backend_plan_by_hand():
    """rollout.backend=hf on 8 x 80 GiB: no vLLM share; during rollouts every trainer state stays and the policy
    generates: the whole model gathered (2 B x P), the KV cache of min(hf_max_batch, 64 / 8 x 8 = 64) sequences
    of 1,024 + 8,192 tokens at 2 x 28 layers x 4 kv heads x 128 x 2 B = 57,344 B per token, the sampler's rows."""
    plan = plan_for(8, 80, "rollout.backend=hf")
    P = 7_615_616_512
    assert not any(i.name.startswith("vLLM") for phase in plan.phases.values() for i in phase)
    rollout = figures(plan, "rollout")
    assert rollout["hf generation: the whole model gathered (2 B/param)"] == (2 * P, True)
    assert plan.kv["bytes_per_token"] == 57_344 and plan.kv["sequences_held"] == 64
    # auto decodes statically on a GPU: a bucket of rows (64 is one) x whole spans of 64 positions (9,216 is 144)
    kv_name = "hf generation: KV cache (64 sequences x 9216 tokens, static: 64 rows x 9216 positions)"
    assert rollout[kv_name] == (64 * 9216 * 57_344, True)
    assert not any(name.endswith(": offloaded") for name in rollout)  # generation reads the bf16 partitions
    assert plan.fits
    eager = figures(plan_for(8, 80, "rollout.backend=hf", "rollout.hf_decoding=eager"), "rollout")
    assert eager["hf generation: KV cache (64 sequences x 9216 tokens)"] == (64 * 9216 * 57_344, True)
    # 40 sequences at once: the static path holds the bucket of 48 rows, and 1,000 + 8,192 rounds up to 9,216
    odd = plan_for(8, 80, "rollout.backend=hf", "rollout.hf_max_batch=40", "data.max_prompt_tokens=1000")
    name = "hf generation: KV cache (40 sequences x 9192 tokens, static: 48 rows x 9216 positions)"
    assert figures(odd, "rollout")[name] == (48 * 9216 * 57_344, True)
    # a batch too large for the card: the problem names the setting
    big = plan_for(
        8,
        80,
        "rollout.backend=hf",
        "rollout.hf_max_batch=512",
        "train.rollout_batch_size=512",
        "train.update_batch_size=512",
    )
    assert not big.fits and any("rollout.hf_max_batch" in p for p in big.problems), big.problems


LORA_1GPU = os.path.join(ROOT, "configs", "trapo_1k_3k_lora_1gpu.yaml")


def test_lora_7b_on_one_80_gib_card_by_hand_and_full_fine_tuning_refused():
    # Adapters, rank 32 on the 7 projections, per layer r x (in + out): q, o 3584 + 3584 each; k, v 3584 + 512
    # each; gate, up 3584 + 18944 each; down 18944 + 3584 -> 32 x 90,112 = 2,883,584; x 28 = 80,740,352.
    assert (
        BUILTIN["Qwen2.5-Math-7B"].lora_params(
            32, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        )
        == 80_740_352
    )
    assert BUILTIN["Qwen2.5-Math-7B"].lora_params(8, ["q_proj", "v_proj"]) == 28 * 8 * (7168 + 4096)
    plan = plan_for(1, 80, config=LORA_1GPU)
    assert plan.fits, plan.problems
    a, p = 80_740_352, 7_615_616_512
    update = figures(plan, "update")
    assert update["frozen base (2 B/param, whole: ZeRO-2)"] == (2 * p, True)  # the shipped config: ZeRO-2
    assert update["adapters (80.7M x 2 B, whole: ZeRO-2)"] == (2 * a, True)
    assert update["gradient partition (4 B/adapter / 1)"] == (4 * a, True)  # fp32 accumulation (deepspeed config)
    assert update["fp32 master weights (4 B/adapter / 1)"] == (4 * a, True)
    assert update["Adam moments (8 B/adapter / 1)"] == (8 * a, True)
    head = next(v for k, v in update.items() if k.startswith("backward: LM head"))
    assert head[0] == 4 * 256 * 152064 * 4 + 2 * 16384 * 3584 * 2  # no [V, H] weight gradient: the head is frozen
    rollout = figures(plan, "rollout")
    assert all(counted for name, (_, counted) in rollout.items() if not name.startswith("  of which"))  # none moved
    # full fine-tuning of the same model on the same card is refused, naming more GPUs
    full = plan_for(1, 80)  # configs/trapo_1k_3k.yaml
    assert not full.fits and any("at least 2 GPUs" in problem for problem in full.problems)
    # LoRA's KL reference is the base with adapters off: no second copy
    assert not any(
        "reference" in name for name in figures(plan_for(1, 80, "loss.beta=0.01", config=LORA_1GPU), "update")
    )
    with pytest.raises(ConfigError, match="the plan knows q_proj"):
        plan_for(1, 80, "model.lora.target_modules=[qkv]", config=LORA_1GPU)


def test_zero2_holds_the_frozen_base_whole_and_gathers_nothing_and_is_for_lora_only():
    path = os.path.join(ROOT, "configs", "deepspeed_zero2.json")
    z3 = plan_for(2, 80, "train.deepspeed_config=configs/deepspeed_zero3.json", config=LORA_1GPU)
    z2 = plan_for(2, 80, f"train.deepspeed_config={path}", config=LORA_1GPU)
    a, p = 80_740_352, 7_615_616_512
    update = figures(z2, "update")
    assert update["frozen base (2 B/param, whole: ZeRO-2)"] == (2 * p, True)
    assert update["adapters (80.7M x 2 B, whole: ZeRO-2)"] == (2 * a, True)
    assert update["gradient partition (4 B/adapter / 2)"] == (4 * a // 2, True)  # gradients and states: partitioned
    assert update["Adam moments (8 B/adapter / 2)"] == (8 * a // 2, True)
    gathered = next(v for k, v in update.items() if k.startswith("backward: gathered"))
    assert (
        gathered[0] == 0
        and next(v for k, v in figures(z3, "update").items() if k.startswith("backward: gathered"))[0] > 0
    )
    # on 2 GPUs the replicated base costs half a base more per GPU than ZeRO-3's partition
    assert (
        z2.peak("update") - z3.peak("update")
        == p - next(v for k, v in figures(z3, "update").items() if k.startswith("backward: gathered"))[0] + 2 * a - a
    )
    with pytest.raises(ConfigError, match="ZeRO stage 2 is for LoRA runs"):
        plan_for(2, 80, f"train.deepspeed_config={path}", "model.lora.rank=0", config=LORA_1GPU)


def test_hf_prefill_activations_by_hand():
    """The issue's 7B shape, 256 prompts of 1,024 tokens on a rank. A prompt token holds 2 B x (3 I + 4 H
    + 2 head_dim) = 2 x (3 x 18,944 + 4 x 3,584 + 2 x 128) = 142,848 B of activations + 1,024 mask booleans
    = 143,872 B: one forward of them all, 262,144 x 143,872 = 37,715,034,112 (35.125 GiB, an H200's peak for
    it); the prefill takes 16,384 // 1,024 = 16 prompts a forward: 16,384 x 143,872 = 2,357,198,848
    (2.20 GiB), counted instead of the sampler's 4 x 256 x 152,064 x 4 = 622,854,144 (never live with it)."""
    batches = ("train.rollout_batch_size=256", "train.update_batch_size=256")
    big = figures(plan_for(8, 80, "rollout.backend=hf", *batches), "rollout")
    assert big["hf generation: prefill activations (16 x 1024 tokens a forward)"] == (2_357_198_848, True)
    assert big["hf generation: sampler rows (4 fp32 [256, V])"] == (622_854_144, False)
    # The paper config's 64 sequences a rank: trainer 2s + 4s + 4s + 8s + 1e9 = 18,135,137,152 + 2 GiB reserve
    # + the model 2 x P = 15,231,233,024 + KV 64 x 9216 x 57,344 = 33,822,867,456 + the same prefill
    # 2,357,198,848 = 71,693,920,128 (66.8 GiB), + on a GPU (auto: static steps) their logits buffer, 64 rows
    # x 152,064 x 2 B = 19,464,192: 71,713,384,320.
    assert plan_for(8, 80, "rollout.backend=hf").peak("rollout") == 71_713_384_320
    eager = plan_for(8, 80, "rollout.backend=hf", "rollout.hf_decoding=eager")
    assert eager.peak("rollout") == 71_693_920_128
    # A prompt over the budget goes alone: 20,000 x (142,848 + 20,000) = 3,256,960,000. Prompts of 16 tokens:
    # 64 x 16 x (142,848 + 16) = 146,292,736, under the sampler's 4 x 64 x 152,064 x 4 = 155,713,536, which
    # then counts.
    long = figures(plan_for(8, 80, "rollout.backend=hf", "data.max_prompt_tokens=20000"), "rollout")
    assert long["hf generation: prefill activations (1 x 20000 tokens a forward)"] == (3_256_960_000, True)
    short = figures(plan_for(8, 80, "rollout.backend=hf", "data.max_prompt_tokens=16"), "rollout")
    assert short["hf generation: prefill activations (64 x 16 tokens a forward)"] == (146_292_736, False)
    assert short["hf generation: sampler rows (4 fp32 [64, V])"] == (155_713_536, True)
