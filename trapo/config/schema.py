"""The configuration's schema: one dataclass per section, with every key's type, default and meaning.

The `Literal` annotations are the allowed choices (checked on loading); a set of choices that other code
names too is a named `Literal` in choices.py.
`ConfigError` is raised for any bad key or value, here (SelectionConfig's range checks) and on loading
and validation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from trapo.config.choices import (
    REFERENCES,
    STRATEGIES,
    Acquire,
    AdvantageScale,
    Aggregation,
    Backend,
    Curriculum,
    Dtype,
    EntropyAgg,
    HfDecoding,
    Mode,
    Objective,
    Placement,
    PromptTemplate,
    Reference,
    RolloutIsMode,
    Strategy,
    UnlabeledKind,
)


class ConfigError(ValueError):
    pass


def flatten(tree: dict, prefix: str = "") -> dict:
    """A nested mapping (a config as a dict, a YAML file, an override) as {dotted key: leaf value}."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# Qwen2's and Llama's linear layers: attention (q, k, v, o) and MLP (gate, up, down).
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraConfig:
    # LoRA adapters (peft; trapo/engine/lora.py): rank 0 trains every parameter. With rank > 0 the base stays
    # frozen in model.dtype, partitioned by ZeRO-3 like the full model, and only the adapters (B A, B = 0 at
    # the start) train: the optimizer holds their states alone. Rollouts see the merged weights
    # W + (alpha / rank) B A, pushed to vLLM after each update; the KL reference is the base (adapters off).
    rank: int = 0
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # on the adapters' input in training only; rollouts never drop (see docs/gpus.md)
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))  # module names (suffixes)


@dataclass
class ModelConfig:
    # A Hugging Face model: a local directory (weights + tokenizer), or a hub id such as Qwen/Qwen2.5-Math-7B,
    # downloaded once per node into the hub cache (trapo/hub.py); empty with toy.enabled.
    path: str = ""
    revision: str | None = None  # hub ids only: a branch, tag or commit (None: the default branch)
    dtype: Dtype = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    rope_theta: float | None = None  # override, e.g. 40000 for Qwen2.5-Math (paper appendix)
    max_position_embeddings: int | None = None  # override, e.g. 16384 for Qwen2.5-Math
    gradient_checkpointing: bool | Literal["auto"] = "auto"  # auto: on only where the memory plan needs it
    # RMSNorm, SwiGLU and rotary embedding as torch.compile'd kernels in the update's forward and backward
    # (trapo/engine/fused_ops.py); generation keeps the plain ops. Compiles once per run (GPU; no-op on CPU).
    fused_kernels: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # parquet (verl layout) or JSONL
    labeled_ratio: float | None = None  # None: use each row's `labeled` flag; else split by ratio with `seed`
    prompt_template: PromptTemplate = "think"
    max_prompt_tokens: int = 1024  # longer prompts are an input error, reported before training
    test_files: list[str] = field(default_factory=list)  # held-out pass@1 before / after training (benchmark files)
    # A labeled row whose gold is empty or prose ("see the solution above") scores 0 against every response:
    # an error naming the row, or with true dropped and counted (trapo/data.py `gold_problem`).
    drop_ungradable_golds: bool = False


@dataclass
class HealthConfig:
    # The rollout engine's health: logprob_diff_rollout_vs_policy, the mean |log pi_policy - log pi_engine|
    # per trained token, or per token of a few probed answers in a step that trains none (nats), watched every
    # step (trapo/training/health.py). Defaults: warn at twice the doctor's bf16 limit (0.05), stop at a mean
    # e-fold error; the levels behind them: docs/reliability.md.
    warn: float | None = 0.1  # a warning (once per run) above this; null: never
    stop: float | None = 1.0  # above this for `steps` consecutive steps the run stops; null: never
    steps: int = 3  # consecutive steps above `stop` (a step above it is never checkpointed)


@dataclass
class RamblingConfig:
    # The rambling guard (trapo/training/rambling.py): the entropy bonus can teach the policy to write
    # high-entropy tokens until rollout.max_tokens, and a policy can loop until it at low entropy
    # (docs/policy-update.md). A step is flagged when its truncated share is at least `truncated` and either
    # its mean token entropy is at least `entropy_factor` x the lowest entropy of the run's unflagged steps so
    # far, or the share has stayed at or above `loop_truncated` for `loop_steps` steps in a row: a warning line
    # names the cause and the knobs (again at most every 50 steps while flags go on); such a step is never
    # checkpointed, and `stop_steps` of them in a row stop the run (null: warn only).
    truncated: float | None = 0.2  # null: the guard is off
    entropy_factor: float = 2.0
    loop_truncated: float | None = 0.9  # null: only the entropy's signature flags a step
    loop_steps: int = 10
    stop_steps: int | None = 5


@dataclass
class RolloutConfig:
    # Who generates: "vllm", a colocated vLLM engine per rank (weights pushed after each update), or "hf",
    # the policy's own transformers model (no vLLM needed, nothing to push; slower at scale: no paged
    # attention). "auto": vllm when it is installed, else hf, chosen once at start-up (one line
    # says which and why) and recorded in the run's config.yaml as what ran; a resume keeps the recorded one
    # unless resume_changes names rollout.backend (trapo/engine/rollout.py choose_backend).
    # trapo/engine/rollout.py.
    backend: Backend = "auto"
    # hf backend: sequences generated at once per rank (questions' G samples together). Its KV cache is
    # batch x (prompt + max_tokens) x layers x 2 x kv_heads x head_dim x dtype bytes. auto: on a GPU the most
    # of the rank's sequences whose cache fits beside the policy (the memory plan's choice, said at start-up);
    # 256 on CPU.
    hf_max_batch: int | Literal["auto"] = "auto"
    # hf backend: how a decode step runs (trapo/engine/static_decoding.py). "eager": transformers' forward,
    # a kernel launch at a time; "static": a KV cache sized once and fixed-shape steps; "cuda_graph": those
    # steps captured once per shape and replayed (CUDA only); "compile": through torch.compile's
    # reduce-overhead mode (CUDA only). "auto": cuda_graph on a GPU for a model the static path takes (a
    # refused capture or a failing static step falls back to eager, said once), eager on CPU.
    hf_decoding: HfDecoding = "auto"
    n: int = 8  # G, rollouts per question
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 3000  # response budget; also the Dr.GRPO loss denominator's length
    # No stop token ends a response before this many tokens (vLLM's min_tokens; transformers' min_new_tokens):
    # benchmarks force lengths with min_tokens = max_tokens. 0: stop tokens end a response anywhere.
    # The policy's log-probs and entropy there are of the same stop-masked distribution (Policy.hold_back).
    min_tokens: int = 0
    # Share of each GPU's memory vLLM may take (weights + KV cache). vLLM sizes its KV cache once, when
    # the engine is built, from this share (sleep and wake map the same pool again: it never grows).
    # During rollouts the trainer keeps its fp32 master weights and Adam moments (~10.5 GB per GPU for
    # 7B on 8 ranks); the bf16 partitions and gradient buffers go to host memory
    # (train.offload_during_rollout), so 0.6 of 80 GB (48 GB: 14 GB of weights, the rest KV cache) fits
    # beside them. Arithmetic, not a GPU measurement: `python -m trapo doctor --plan` works it out for
    # any config and card; lower it for larger models or smaller GPUs.
    gpu_memory_utilization: float = 0.6
    cpu_kv_cache_gb: float = 0.25  # CPU only: vLLM needs an explicit KV-cache size there
    enable_sleep_mode: bool = True  # GPU only: free vLLM's memory while the policy trains
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1  # ranks sharing one vLLM engine (consecutive ranks); must divide the world size
    eval_temperature: float = 0.0  # held-out check in the trainer (greedy by default)
    # DAPO dynamic sampling (trapo/training/sampling.py): groups whose G rewards are all equal (every response right,
    # or every one wrong: advantage 0, no gradient) leave the update; while fewer than
    # train.rollout_batch_size informative groups (all ranks) remain, the step rolls out the epoch's next
    # batch, then keeps exactly that many in the batch order. Refills consume the epoch's batches (they are
    # not rolled out again that epoch) and never cross its end, so an epoch has fewer steps; `epochs` still
    # counts epochs (max_steps, when set, counts steps). Every question rolled out, filtered or not, gives
    # its pass rate to the trajectories; refills are gated by the selection of the last epoch end.
    dynamic_sampling: bool = False
    # Generation rounds per step at most, the first included (veRL's max_num_gen_batches; DAPO's recipe
    # uses 10); 0: no limit but the epoch's end. Reached with too few informative groups, the step trains
    # on those it has (veRL stops the run instead).
    dynamic_sampling_max_rounds: int = 10
    # Where the engines run. "colocated": on every training rank, taking turns with the update (the
    # default). "separate": the launcher's last `ranks` processes hold only rollout engines (hf backend),
    # the others train; weights go to them after every step over their own process group
    # (trapo/engine/rollout_link.py, docs/async-rollouts.md).
    placement: Placement = "colocated"
    ranks: int = 1  # separate: how many of the launched processes are rollout ranks
    # separate: how many updates a round's weights may lag the trainer's. 0: each round waits for the
    # last push (equals colocated); s: step t trains on the rollouts of the weights after max(0, t-1-s)
    # updates, generated while the trainer updated (loss.rollout_is is then on: truncate unless set).
    max_staleness: int = 0
    health: HealthConfig = field(default_factory=HealthConfig)
    rambling: RamblingConfig = field(default_factory=RamblingConfig)


@dataclass
class TrainConfig:
    rollout_batch_size: int = 64  # questions per step, across all ranks (paper: 64)
    update_batch_size: int = 64  # questions per optimizer update (paper: 64 -> one update per step)
    lr: float = 1e-6  # constant (paper appendix)
    weight_decay: float = 0.0
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    micro_batch_tokens: int = 16384  # tokens (padded ones too without packing) per forward/backward on one rank
    # torch's intra-op CPU threads while the policy updates (its forward and backward passes); None: the process's
    # (OMP_NUM_THREADS, 1 on CPU by default). On a small CPU a colocated vLLM engine generates fastest on one
    # thread while the update gains from every core (docs/real-model.md).
    update_threads: int | None = None
    # Response tokens per chunk of the LM head (trapo.algorithm.logits.lm_head_token_stats). auto: on a GPU the
    # largest whose fp32 logits fit beside the update (the memory plan's choice, said at start-up); 256 on CPU.
    loss_chunk_tokens: int | Literal["auto"] = "auto"
    # ZeRO-3: keep every parameter gathered after its first use instead of gathering and releasing each module
    # on every pass. auto: on one training GPU where the whole model fits beside the update (the memory plan's
    # choice, said at start-up); off on CPU and on several GPUs, where ZeRO-3's partitioning is the point.
    param_persistence: bool | Literal["auto"] = "auto"
    # GPU: move the bf16 partitions and gradient buffers to host memory while vLLM generates, so that
    # its KV cache (sized at engine build) can be mapped again beside what stays; None: on with a GPU and
    # rollout.backend vllm (the hf backend generates with those partitions, so it keeps them).
    # (DeepSpeed 0.19 moves the fp32 master and Adam moments only for its own FusedAdam; with our
    # torch AdamW they stay on the GPU.)
    offload_during_rollout: bool | None = None
    deepspeed_config: str = "configs/deepspeed_zero3.json"
    max_bad_steps: int = 3  # consecutive non-finite losses before the run stops
    # Sequences concatenated into one row per micro-batch (no padding), each attending only to itself
    # (trapo/engine/packing.py); false: right-padded micro-batches, sequences of similar length together.
    packing: bool = True
    # Each update batch's sequences redistributed so every rank trains a near-equal number of tokens
    # (ZeRO-3 makes all ranks wait for the busiest one at every micro-batch).
    balance_ranks: bool = True
    # Skip sequences with advantage 0 (a group whose rewards are all equal, Dr.GRPO): None skips them
    # when that is exact (loss.entropy_coef == 0 and loss.beta == 0: their gradient is exactly 0); true
    # also when it is not (their entropy and KL terms are then dropped); false never.
    skip_zero_advantage: bool | None = None


@dataclass
class LossConfig:
    agg: Aggregation = "dr_grpo"
    advantage_scale: AdvantageScale = "none"
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    # KL(pi_theta || pi_ref) to the initial weights, k3 ("low-variance") estimator; the paper uses 0 (then
    # no reference model is loaded), the authors' public veRL script 0.001 (configs/trapo_1k_3k_verl.yaml)
    beta: float = 0.0
    entropy_coef: float = 0.01  # the entropy bonus's weight (with entropy_target: its starting value)
    # How the bonus's token entropies are reduced: "loss", the loss's own `agg` (the paper's; under dr_grpo
    # a sum over tokens with a constant denominator, so it grows with response length), or "token_mean",
    # the mean over the batch's response tokens (does not grow with length).
    entropy_agg: EntropyAgg = "loss"
    # Adaptive entropy control (trapo/algorithm/entropy_control.py): null, a fixed entropy_coef; a number,
    # the target mean token entropy (nats): after each step the coefficient moves by entropy_coef_step
    # towards raising (entropy below target) or lowering (above) the entropy, clamped to
    # [0, entropy_coef_max]; logged as entropy_coef.
    entropy_target: float | None = None
    entropy_coef_step: float = 0.002
    entropy_coef_max: float = 0.05
    # The policy loss (trapo/algorithm/loss.py policy_loss): GRPO's clipped token surrogate; GSPO's sequence-level
    # ratio (geometric mean) clipped to its own small range; CISPO's REINFORCE term weighted by the
    # detached IS ratio clipped at 1 + (clip_eps_high or clip_eps), no lower bound. GSPO's paper
    # objective averages each sequence's tokens, then the sequences: pair it with agg seq_mean.
    objective: Objective = "grpo"
    gspo_clip_eps: float = 3e-4  # GSPO's clip below 1 (the paper's 3e-4)
    gspo_clip_eps_high: float = 4e-4  # and above 1 (the paper's 4e-4)
    # Rollout importance correction of each token's policy-gradient term for the small mismatch between
    # vLLM's and the trainer's kernels, ratio pi_old / pi_engine (trapo/algorithm/importance.py): truncate
    # min(ratio, cap); token_mask: the ratio, 0 for tokens whose ratio leaves [lower, cap]; sequence_mask:
    # the sequence's geometric-mean ratio, 0 for all its tokens when that leaves [lower, cap]. The
    # objective's terms are multiplied by it. None: truncate with a GPU (where the
    # kernels differ), off on CPU (both run the same fp32 math and the ratio is 1 to ~1e-6). YAML reads a
    # bare `off` as false, so false means off, and true the earlier boolean's truncate.
    rollout_is: RolloutIsMode | bool | None = None
    rollout_is_cap: float = 2.0  # the upper bound; TRL's default cap
    rollout_is_lower: float | None = None  # the mask modes' lower bound; None: 1 / rollout_is_cap (veRL)
    # DAPO's overlong handling: mask drops responses cut at rollout.max_tokens from the loss (and its
    # denominators); soft_penalty adds R_len (0 up to max_tokens - buffer, then a ramp to -penalty)
    # to every response's reward before the group advantages (pass rates are untouched).
    overlong: Literal["none", "mask", "soft_penalty"] = "none"
    overlong_buffer: int | None = None  # DAPO's L_cache in tokens; None: rollout.max_tokens // 5 (DAPO's 4K of 20K)
    overlong_penalty: float = 1.0  # the penalty at and beyond max_tokens (DAPO: 1)

    def overlong_buffer_tokens(self, max_tokens: int) -> int:
        return max_tokens // 5 if self.overlong_buffer is None else self.overlong_buffer


@dataclass
class ScrlConfig:
    """SCRL's thresholds (arXiv 2603.19880; its code's defaults): `reward.unlabeled: scrl`."""

    positive: float = 0.5  # tau_pos: the largest cluster's share must reach this for a positive pseudo-label
    margin: float = 0.15  # tau_marg: ... and beat the second largest's share by more than this
    rare: float = 0.15  # tau_low: a cluster with a smaller share, less sure than the group, is a negative label


@dataclass
class RewardConfig:
    # an unlabeled answer's reward (trapo/algorithm/rewards/unlabeled.py): majority (TTRL: 1 in the majority
    # cluster), cluster_share (EMPO: the share of the G answers in its cluster), scrl (SCRL: +1 in a strong
    # majority, -1 in a rare unsure cluster or without an answer, else 0), or a confidence score (Table 1)
    unlabeled: UnlabeledKind = "majority"
    scrl: ScrlConfig = field(default_factory=ScrlConfig)
    timeout: float = 5.0  # seconds per Math-Verify comparison
    step_budget: float | None = 60.0  # seconds for one step's grading on a rank; then undecided = not equal
    workers: int = 2  # Math-Verify worker processes per rank
    # What an answer is and when two are equal, for rewards and the vote: math (Math-Verify), mcq (option
    # letters), exact (normalized strings) or "module:name", a task verifier importable from PYTHONPATH
    # (docs/tasks.md, trapo/algorithm/rewards/verifiers.py)
    verifier: str = "math"


# Keys that no longer exist -> what replaces them (a clearer error than a did-you-mean guess).
REMOVED_KEYS = {"selection.random": "replaced by selection.strategy=random"}


@dataclass
class SelectionConfig:
    """How unlabeled questions are gated (paper defaults: top-p 0.1, Gamma 0.4); `trapo.algorithm.passrate` uses it
    as is."""

    warmup_epochs: int = 8
    top_p: float = 0.1
    threshold: float = 0.4  # Gamma
    reference: Reference = "mean_trajectory"
    standardize: bool = False  # z-score trajectories first (paper's public code)
    # Which score ranks the unlabeled questions (paper section "Different Selection Strategies"):
    # "tcs" (TraPO), "random" (the "random_select" control, seeded by random_seed and the epoch),
    # "entropy" (mean sentence log-likelihood of the G responses: lower sentence entropy = more
    # reliable) or "self_certainty" (mean self-certainty of the G responses). The last two need a
    # forward pass of the policy over the unlabeled questions' responses (reused from the reward
    # when reward.unlabeled is the same measure).
    strategy: Strategy = "tcs"
    # None: select as many as the paper's rule (top-p OR TCS >= Gamma) picks -- by that rule for
    # "tcs", by the strategy's own ranking (a count-matched control) for the others. A number r:
    # exactly the top floor(r * U) of the U unlabeled questions by the strategy's score (the
    # paper's fixed-ratio tables use 0.1, 0.3, 0.5 and 0.7).
    fixed_ratio: float | None = None
    random_seed: int | None = None  # None: the run's seed

    def __post_init__(self) -> None:  # the tracker is also built from a SelectionConfig made by hand
        if problems := self.problems():
            key, problem = problems[0]
            raise ConfigError(f"config: key '{key}': {problem}")

    def problems(self) -> list[tuple[str, str]]:
        """The range checks as (dotted key, what is wrong), for direct construction and for validation."""
        found = []
        if self.warmup_epochs < 0:
            found.append(("selection.warmup_epochs", f"must be >= 0, got {self.warmup_epochs}"))
        if not 0.0 <= self.top_p <= 1.0:
            found.append(("selection.top_p", f"must be in [0, 1], got {self.top_p}"))
        if self.reference not in REFERENCES:
            found.append(("selection.reference", f"must be one of {REFERENCES}, got {self.reference!r}"))
        if self.strategy not in STRATEGIES:
            found.append(("selection.strategy", f"must be one of {STRATEGIES}, got {self.strategy!r}"))
        if self.fixed_ratio is not None and not 0.0 <= self.fixed_ratio <= 1.0:
            found.append(("selection.fixed_ratio", f"must be in [0, 1] or null, got {self.fixed_ratio}"))
        return found


@dataclass
class SamplingConfig:
    """Which questions an epoch rolls out (trapo/algorithm/curriculum.py, trapo/training/curriculum.py)."""

    # "none": every question every epoch. "trajectory": a labeled question whose last `curriculum_window`
    # observed pass rates are all 1 (or all 0) gives zero-advantage groups, so it leaves the next epochs'
    # batches, except once every `curriculum_readmit_every` epochs (to notice a forgotten one); the epoch
    # then draws its full batches from the questions left. Unlabeled questions are never skipped.
    curriculum: Curriculum = "none"
    curriculum_window: int = 3  # k: recorded pass rates that must all be 1 (or all 0)
    curriculum_readmit_every: int = 4  # m: a skipped question is rolled out again every m-th epoch


@dataclass
class LabelsConfig:
    """Gold labels bought during training (trapo/algorithm/acquisition.py): at each epoch end, `per_epoch`
    unlabeled questions whose hidden gold the data holds, chosen by `acquire`, become labeled for the rest of
    the run, until `budget` are bought. A bought question is never bought twice; labels.jsonl logs each."""

    budget: int = 0  # gold labels to buy over the run; 0: none
    per_epoch: int | None = None  # labels bought at an epoch end; None: the budget spread over the run's epochs
    # care: the largest expected error of the group's advantages under its pseudo-label (RLAVR/CARE), tcs: the
    # least TraPO-like trajectories (lowest TCS), random: uniform
    acquire: Acquire = "care"


@dataclass
class EvalConfig:
    # Validation benchmarks (parquet / JSONL), see trapo/commands/eval.py.
    files: list[str] = field(default_factory=list)
    steps: int = 0  # evaluate every N steps (0: never); the best score's checkpoint is kept and named in best.json
    n: int = 1  # samples per question (avg@n)
    temperature: float = 0.6  # the paper's evaluation temperature
    max_tokens: int | None = None  # None: rollout.max_tokens
    # The trainer's held-out check (data.test_files) also scores avg@k at eval.temperature beside its greedy
    # pass@1, before and after training: k samples per question; 0: greedy only. The paper reports avg@k.
    heldout_k: int = 0
    # The benchmark (a file's name without extension) whose score picks the best checkpoint; None: the
    # mean over eval.files. Lets test splits be scored along the way without choosing the checkpoint.
    select_on: str | None = None


@dataclass
class WandbConfig:
    """Weights & Biases (trapo/training/loggers.py): every metrics.jsonl scalar at its step, from rank 0."""

    enabled: bool = False
    project: str = "trapo"
    run_name: str | None = None  # None: the run's run_name
    mode: Literal["online", "offline"] = "online"  # offline: files under run_dir/wandb/ only (`wandb sync` later)
    tags: list[str] = field(default_factory=list)


@dataclass
class MlflowConfig:
    """MLflow tracking (trapo/training/loggers.py): every metrics.jsonl scalar at its step, from rank 0."""

    enabled: bool = False
    # None: $MLFLOW_TRACKING_URI when set, else a file store in run_dir/mlruns. sqlite:/SQL stores need the
    # full `mlflow` package (SQLAlchemy); requirements.txt pins the lighter mlflow-skinny.
    tracking_uri: str | None = None
    experiment: str = "trapo"
    run_name: str | None = None  # None: the run's run_name


@dataclass
class LoggingConfig:
    level: Literal["info", "debug"] = "info"  # debug: library logs on the terminal too (also TRAPO_LOG_LEVEL=debug)
    tensorboard: bool = False  # also write every metrics.jsonl scalar to run_dir/tensorboard/
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    # Every N steps, run_dir/rollouts/step-K.jsonl: each question's prompt, G responses, answers, rewards,
    # pseudo-label and gate (trapo/training/rollout_dump.py); 0: never.
    rollouts_every: int = 0


@dataclass
class ToyConfig:
    enabled: bool = False  # build the embedded toy model and data (see trapo/commands/toy.py)
    task: Literal["addition", "trap", "reverse"] = "addition"  # reverse: a string task (docs/tasks.md)
    trap_rate: float = 0.6  # trap task: share of borrow questions the warm start's teacher gets wrong
    dir: str = "outputs/toy-assets"
    seed: int = 0
    labeled: int = 64
    unlabeled: int = 192
    test: int = 128
    validation: int = 0  # held-out questions for checkpoint selection (validation.jsonl), disjoint from test
    unlabeled_ood: int = 0  # trap task: OOD additions for an unlabeled-OOD training set (unlabeled_ood.jsonl)
    sft_steps: int = 150
    # The warm start's AdamW rate. At 3e-3 (as calibrated for the tests' short fits) a long addition fit sits
    # on a plateau for 1000-2500 steps, and when it leaves depends on the CPU's rounding; at 1e-3 it has no
    # plateau (configs/toy.yaml; docs/upstream-notes.md).
    sft_lr: float = 3e-3
    # "constant" keeps sft_lr throughout; "decay" clips the gradient norm at 1 and decays the rate linearly
    # to 0, so the fit converges. A constant rate leaves the model wherever its last loss spike put it, which
    # differs from one CPU's rounding to another's (measured: docs/upstream-notes.md).
    sft_schedule: Literal["constant", "decay"] = "constant"
    # Addition task: share of the warm start's drawn examples the teacher answers with a slip (a+b+10, drawn
    # afresh each time). With "decay" the fit then converges to the teacher's answer distribution, the same on
    # any CPU: greedy answers right, sampled ones right about 1 - sft_noise of the time (configs/toy.yaml).
    sft_noise: float = 0.0

    @property
    def asset_dir(self) -> Path:
        """Where `trapo.commands.toy.build_assets` writes this task's model and data, and training reads them."""
        return Path(self.dir) / (f"seed-{self.seed}" if self.task == "addition" else f"{self.task}-seed-{self.seed}")


@dataclass
class Config:
    run_name: str = "run"
    output_dir: str = "outputs"
    mode: Mode = "trapo"
    seed: int = 0
    epochs: int = 1
    max_steps: int | None = None  # None: epochs * steps per epoch
    save_steps: int = 0  # 0: only at the end
    keep_checkpoints: int | None = None  # None keeps all
    resume_from: str | None = None  # "latest" or a checkpoint directory
    # Keys a resume may change although they alter what the run means or break its exact resume (trapo/
    # training/run_record.py: steps, saving, logging and evaluation may change without being named here).
    resume_changes: list[str] = field(default_factory=list)
    progress_bar: bool = True
    # How long a collective may wait for the other ranks before the run stops with a message (a rank
    # that died or hangs on another node): the longest a healthy rank waits is a checkpoint save or
    # a validation pass of the others; torch's default would be 30 minutes (10 under NCCL).
    dist_timeout_minutes: float = 20.0
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    labels: LabelsConfig = field(default_factory=LabelsConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    toy: ToyConfig = field(default_factory=ToyConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.run_name
