"""The embedded default task: a tiny Qwen2 and synthetic arithmetic, built here, no hub.

`build_assets(cfg)` writes, once per configuration, under `cfg.dir`:
- `model/`: a tiny Qwen2 (hidden 128, 4 query heads of size 32 (the smallest
  head size vLLM's CPU attention takes), 2 KV heads, 2 layers) with a byte-level
  BPE tokenizer trained on the task's text, warm-started by a short supervised
  fit so that its sampled pass rate on the training questions is neither 0 nor 1;
- `train.jsonl`: `labeled` questions with answers, then `unlabeled` ones whose
  answers are kept as hidden golds (diagnostics only);
- `test.jsonl`: held-out questions; `validation.jsonl` (`validation` > 0): more
  held-out questions from the same pool, for checkpoint selection.

Two task families (`cfg.task`):
- `addition` (the `make train` default): "a+b=" with two-digit a, b, answer
  `\\boxed{a+b}`; the warm start sees a disjoint pool of questions. configs/toy.yaml's
  teacher slips on 30% of its draws (a+b+10, `sft_noise`) and the fit runs to
  convergence (`sft_schedule: decay` from `sft_lr` 1e-3): greedy answers right, sampled
  ones right about 70% of the time, the same model on any CPU's kernels (a fit stopped
  mid-way, or one at 3e-3 still on its plateau, is not: where it stands then differs
  between AVX2 and AVX-512 rounding).
- `trap` (`make reproduce-toy`): "a-b=" with two-digit a > b, where self-consistency
  can be wrong. When a column needs a borrow (a's units digit < b's), the warm
  start's teacher is buggy for `trap_rate` of such questions: it subtracts the
  smaller digit from the larger in each column (52-17 -> 45 instead of 35), the
  classic student error. The model so learns a consistent wrong answer on part
  of the borrow questions, and a majority vote there is confidently wrong.
  The out-of-domain family is two-digit addition, taught correctly, written to
  `test_ood.jsonl`; `unlabeled_ood` more of them (answers as hidden golds) go to
  `unlabeled_ood.jsonl`, for the paper's labeled-ID + unlabeled-OOD setting.
- `reverse` (docs/tasks.md, configs/toy_reverse.yaml): "reverse FCAB =" with four letters A-H, answered
  `answer: BACF`; its answers are strings, not math, so it trains with a task verifier
  (`trapo/commands/toy_verifier.py`, `reward.verifier`). Letters are single tokens.
Deterministic given `cfg.seed`.
"""

from __future__ import annotations

import itertools
import json
import random
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch

from trapo import console
from trapo.config import Config, ToyConfig

EOS = "<|endoftext|>"
FORMAT_VERSION = 4  # 4: toy.sft_lr (configs/toy.yaml's warm start at 1e-3, no plateau)


def _problems(seed: int) -> list[tuple[str, str]]:
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    return [(f"{a}+{b}=", str(a + b)) for a, b in pairs]


def needs_borrow(a: int, b: int) -> bool:
    return a % 10 < b % 10


def buggy_difference(a: int, b: int) -> int:
    """The no-borrow error: each column subtracts the smaller digit from the larger."""
    return 10 * abs(a // 10 - b // 10) + abs(a % 10 - b % 10)


def _subtractions(seed: int) -> list[tuple[int, int]]:
    pairs = [(a, b) for a in range(11, 100) for b in range(10, a) if a // 10 != b // 10]
    random.Random(seed).shuffle(pairs)
    return pairs


def response_text(answer: str, task: str = "addition") -> str:
    return f"answer: {answer}" if task == "reverse" else f"\\boxed{{{answer}}}"


REVERSE_LETTERS = "ABCDEFGH"


def _reversals(seed: int) -> list[tuple[str, str]]:
    words = ["".join(w) for w in itertools.product(REVERSE_LETTERS, repeat=4)]
    random.Random(seed).shuffle(words)
    return [(f"reverse {w} =", w[::-1]) for w in words]


def _tokenizer(corpus: list[str], letters: bool = False):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits stay single tokens (as in Qwen2's tokenizer), so numbers are spelled digit by digit.
    steps = [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    if letters:  # the reverse task: each letter its own token, as each digit is
        steps.insert(0, pre_tokenizers.Split(Regex("[A-Z]"), "isolated"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)


# The toy model's shape (a Qwen2): hidden 128 in 4 heads of 32 (vLLM's CPU kernels need head size >= 32),
# 2 layers; positions for real benchmark prompts in `make eval`. The benches build models of this shape too.
MODEL_SHAPE = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def _model(tokenizer, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=(len(tokenizer) + 63) // 64 * 64,
        **MODEL_SHAPE,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        dtype="float32",
    )
    return Qwen2ForCausalLM(config)


SLIP = 10  # what a noisy teacher adds to a+b when it slips (toy.sft_noise): one systematic error, the tens digit + 1


def _warm_start(
    model,
    tokenizer,
    problems: list[tuple[str, str]],
    steps: int,
    seed: int,
    schedule: str,
    task: str = "addition",
    noise: float = 0.0,
    lr: float = 3e-3,
) -> None:
    """Supervised fit on (prompt, response) pairs; loss on response tokens only. schedule: ToyConfig.sft_schedule.

    noise > 0 (numeric answers): each drawn example's answer is, with that probability, a+b+SLIP
    instead, drawn afresh at every draw; the fit then learns the answer distribution itself
    (ToyConfig.sft_noise)."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    decay = schedule == "decay"
    rate = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / steps if decay else 1.0)
    eos = tokenizer.eos_token_id
    encoded = []
    for q, a in problems:
        p = tokenizer(q)["input_ids"]
        r = tokenizer(response_text(a, task))["input_ids"] + [tokenizer.eos_token_id]
        encoded.append((p, r))
    model.train()
    for _ in range(steps):
        idx = torch.randint(len(encoded), (64,), generator=gen).tolist()
        batch = [encoded[i] for i in idx]
        if noise:  # drawn only with noise, so a noise-free fit draws exactly what it drew before the setting
            slipped = (torch.rand(len(idx), generator=gen) < noise).tolist()
            for row, i in enumerate(idx):
                if slipped[row]:
                    wrong = str(int(problems[i][1]) + SLIP)
                    batch[row] = (encoded[i][0], tokenizer(response_text(wrong, task))["input_ids"] + [eos])
        seqs = [p + r for p, r in batch]
        length = max(map(len, seqs))
        ids = torch.full((len(seqs), length), tokenizer.eos_token_id)  # [b, T]
        labels = torch.full((len(seqs), length), -100)  # [b, T]
        attn = torch.zeros(len(seqs), length, dtype=torch.long)  # [b, T]
        for row, (p, r) in enumerate(batch):
            ids[row, : len(p) + len(r)] = torch.tensor(p + r)
            labels[row, len(p) : len(p) + len(r)] = torch.tensor(r)
            attn[row, : len(p) + len(r)] = 1
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        if decay:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        rate.step()
    model.eval()


def _write_questions(path: Path, prefix: str, pairs: list[tuple[str, str]], labeled: list[bool] | None = None):
    """One JSONL row per (question, answer), with id prefix + index and, when given, each row's `labeled` flag."""
    rows = [{"id": f"{prefix}{i}", "question": q, "answer": a} for i, (q, a) in enumerate(pairs)]
    for row, flag in zip(rows, labeled or []):
        row["labeled"] = flag
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def prepare(cfg: Config) -> None:
    """Collective: with `toy.enabled`, rank 0 builds (or reuses) the toy's assets while the other ranks wait.

    Every entry point that trains on the toy (`python -m trapo train`, the doctor's trial run) calls this
    before it builds the `Trainer`, which only reads the assets (`cfg.toy.asset_dir`). A prompt and
    response budget past the toy model's context is a ConfigError, raised before anything is built."""
    if not cfg.toy.enabled:
        return
    from trapo.engine import dist
    from trapo.training.inputs import check_context

    # the toy model's context, known before it is built: a budget past it is refused now, not after the build
    positions = cfg.model.max_position_embeddings or MODEL_SHAPE["max_position_embeddings"]
    check_context(cfg, (positions, "max_position_embeddings"), "the toy model")

    rank, _, _ = dist.init_distributed(cfg.dist_timeout_minutes)
    if rank == 0:
        build_assets(cfg.toy, log=console.say)
    dist.barrier()


def build_assets(cfg: ToyConfig, log=print) -> Path:
    """Build (or reuse) the toy model and data; returns the asset directory."""
    root = cfg.asset_dir
    # What the assets are: neither where they live nor the `enabled` switch (a caller building them for a run
    # with toy.enabled=false, as the tests and the reproduction do, reuses what a toy run built, and back).
    manifest = {"format": FORMAT_VERSION, **asdict(cfg)}
    manifest.pop("dir")
    manifest.pop("enabled")
    if cfg.sft_schedule == "constant":  # the schedule before it was a setting: those assets still match
        manifest.pop("sft_schedule")
    done = root / "manifest.json"
    if done.is_file() and {k: v for k, v in json.loads(done.read_text()).items() if k != "enabled"} == manifest:
        return root
    started = time.perf_counter()
    n_task = cfg.labeled + cfg.unlabeled + cfg.validation + cfg.test
    if cfg.task != "addition" and cfg.sft_noise:
        raise ValueError(f"toy: sft_noise needs task 'addition' (its slips are a+b+10; the task is {cfg.task})")
    if cfg.task != "trap" and cfg.unlabeled_ood:
        raise ValueError(f"toy: unlabeled_ood needs task 'trap' (the {cfg.task} task has no OOD family)")
    if cfg.task == "reverse":
        problems = _reversals(cfg.seed)
        if n_task + 1000 > len(problems):
            raise ValueError(f"toy: {n_task} questions requested; at most {len(problems) - 1000} available")
        task, warm, ood, ood_train = problems[:n_task], problems[n_task:], [], []
        corpus = [q + response_text(a, cfg.task) for q, a in problems]
    elif cfg.task == "addition":
        problems = _problems(cfg.seed)
        if n_task + 1000 > len(problems):
            raise ValueError(f"toy: {n_task} questions requested; at most {len(problems) - 1000} available")
        task, warm, ood, ood_train = problems[:n_task], problems[n_task:], [], []
        corpus = [q + response_text(a) for q, a in problems]
    else:
        task, warm, ood, ood_train, corpus = _trap_problems(cfg, n_task)
    tokenizer = _tokenizer(corpus, letters=cfg.task == "reverse")
    model = _model(tokenizer, cfg.seed)
    with torch.random.fork_rng():
        _warm_start(
            model, tokenizer, warm, cfg.sft_steps, cfg.seed, cfg.sft_schedule, cfg.task, cfg.sft_noise, cfg.sft_lr
        )

    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "model").mkdir(parents=True)
    model.save_pretrained(tmp / "model", safe_serialization=True)
    tokenizer.save_pretrained(tmp / "model")
    n_train = cfg.labeled + cfg.unlabeled
    _write_questions(tmp / "train.jsonl", "q", task[:n_train], labeled=[i < cfg.labeled for i in range(n_train)])
    held_out = task[n_train:]  # validation, then test
    _write_questions(tmp / "test.jsonl", "t", held_out[cfg.validation :])
    if cfg.validation:
        _write_questions(tmp / "validation.jsonl", "v", held_out[: cfg.validation])
    if ood_train:
        _write_questions(tmp / "unlabeled_ood.jsonl", "u", ood_train, labeled=[False] * len(ood_train))
    if ood:
        _write_questions(tmp / "test_ood.jsonl", "o", ood)
    (tmp / "manifest.json").write_text(json.dumps(manifest))
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    log(f"toy: built model and data in {root} ({time.perf_counter() - started:.1f} s)")
    return root


def _trap_problems(cfg: ToyConfig, n_task: int):
    """(task questions, warm-start pairs, OOD test questions, OOD training questions, tokenizer corpus).

    Task and test questions are half borrow, half no-borrow subtractions; the warm
    start gets disjoint subtractions (the buggy teacher on `trap_rate` of its
    borrow ones, chosen per question) plus correctly taught additions.
    """
    rng = random.Random(cfg.seed)
    subs = _subtractions(cfg.seed)
    borrow = [p for p in subs if needs_borrow(*p)]
    plain = [p for p in subs if not needs_borrow(*p)]
    half = n_task // 2
    if half + 600 > min(len(borrow), len(plain)):
        raise ValueError(f"toy: {n_task} trap questions requested; too many for the subtraction pool")
    task_pairs = borrow[:half] + plain[: n_task - half]
    rng.shuffle(task_pairs)
    task = [(f"{a}-{b}=", str(a - b)) for a, b in task_pairs]
    warm = [
        (f"{a}-{b}=", str(buggy_difference(a, b) if rng.random() < cfg.trap_rate else a - b)) for a, b in borrow[half:]
    ]
    warm += [(f"{a}-{b}=", str(a - b)) for a, b in plain[n_task - half :]]
    adds = _problems(cfg.seed + 1)
    ood = adds[: cfg.test]
    n_warm_adds = len(warm)  # as many additions as subtractions
    warm += adds[cfg.test : cfg.test + n_warm_adds]
    ood_train = adds[cfg.test + n_warm_adds : cfg.test + n_warm_adds + cfg.unlabeled_ood]
    if len(ood_train) < cfg.unlabeled_ood:
        raise ValueError(f"toy: {cfg.unlabeled_ood} unlabeled OOD questions requested; too many for the addition pool")
    rng.shuffle(warm)
    corpus = [q + response_text(a) for q, a in task + warm + ood + ood_train]
    return task, warm, ood, ood_train, corpus
