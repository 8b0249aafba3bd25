"""The toy tasks: the trap family's arithmetic and splits; the reverse task and its verifier."""

import dataclasses
import math

from trapo.commands import toy
from trapo.config import ToyConfig


def test_borrow_and_the_no_borrow_error():
    assert toy.needs_borrow(52, 17) and not toy.needs_borrow(57, 12)
    assert toy.buggy_difference(52, 17) == 45  # 5-1 = 4, |2-7| = 5
    assert toy.buggy_difference(57, 12) == 57 - 12  # without a borrow the "bug" is right


def test_trap_splits_are_balanced_and_disjoint():
    cfg = ToyConfig(task="trap", labeled=20, unlabeled=60, test=40, unlabeled_ood=30)
    task, warm, ood, ood_train, _ = toy._trap_problems(cfg, 120)
    qs = [q for q, _ in task]
    assert len(task) == 120 and len(set(qs)) == 120
    borrow = sum(toy.needs_borrow(*map(int, q[:-1].split("-"))) for q in qs)
    assert borrow == 60  # half of the questions need a borrow
    assert all(a == str(eval(q[:-1])) for q, a in task)  # task golds are right  # noqa: S307
    assert not set(qs) & {q for q, _ in warm}  # the warm start never sees a task question
    wrong = [(q, a) for q, a in warm if "-" in q and a != str(eval(q[:-1]))]  # noqa: S307
    assert wrong and all(a == str(toy.buggy_difference(*map(int, q[:-1].split("-")))) for q, a in wrong)
    assert len(ood) == 40 and all("+" in q for q, _ in ood)
    assert len(ood_train) == 30 and all("+" in q for q, _ in ood_train)
    warm_q = {q for q, _ in warm}
    assert not {q for q, _ in ood} & {q for q, _ in ood_train} and not (warm_q & {q for q, _ in ood + ood_train})


def test_validation_split_is_held_out(tmp_path):
    import json

    cfg = ToyConfig(
        enabled=True,
        task="trap",
        dir=str(tmp_path),
        labeled=8,
        unlabeled=24,
        test=16,
        validation=16,
        unlabeled_ood=12,
        sft_steps=1,
    )
    root = toy.build_assets(cfg, log=lambda _: None)

    def questions(name):
        return [json.loads(x)["question"] for x in (root / name).read_text().splitlines()]

    train, val, test = questions("train.jsonl"), questions("validation.jsonl"), questions("test.jsonl")
    assert (len(train), len(val), len(test)) == (32, 16, 16)
    assert not set(val) & set(test) and not set(val) & set(train) and not set(test) & set(train)
    ood = [json.loads(x) for x in (root / "unlabeled_ood.jsonl").read_text().splitlines()]
    assert len(ood) == 12 and not any(r["labeled"] for r in ood) and all("+" in r["question"] for r in ood)


def test_assets_built_with_the_switch_off_are_reused_with_it_on_and_a_real_change_rebuilds(tmp_path):
    """The manifest records what the assets are: a build for toy.enabled=false (the tests' fixture, the
    reproduction's base) is what a toy run reuses, not a reason to rebuild it (two runs rebuilding one
    directory at once collided)."""
    import json

    built = []
    cfg = ToyConfig(enabled=False, dir=str(tmp_path), labeled=8, unlabeled=24, test=8, sft_steps=1)
    root = toy.build_assets(cfg, log=built.append)
    assert len(built) == 1 and "enabled" not in json.loads((root / "manifest.json").read_text())
    toy.build_assets(dataclasses.replace(cfg, enabled=True), log=built.append)
    assert len(built) == 1  # reused
    toy.build_assets(dataclasses.replace(cfg, enabled=True, sft_steps=2), log=built.append)
    assert len(built) == 2  # what the assets are changed: built again


def test_a_response_budget_past_the_toy_models_context_is_refused_before_the_build(tmp_path):
    """rollout.max_tokens past the toy model's 2,048 positions: one line naming the key and the fix, status 2,
    before the toy model is built (vLLM would refuse it only after the build and the policy's load)."""
    import subprocess
    import sys

    from trapo import runtime

    cmd = [sys.executable, "trapo_train.py", f"toy.dir={tmp_path / 'toy'}", f"output_dir={tmp_path / 'runs'}"]
    cmd += ["rollout.max_tokens=4096", "progress_bar=false"]
    env = runtime.subprocess_env()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=runtime.ROOT, timeout=300)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and "Traceback" not in out.stderr and len(lines) == 1, out.stderr[-3000:]
    assert lines[0].endswith(
        "data.max_prompt_tokens + rollout.max_tokens = 4112 tokens exceeds what the toy model serves "
        "(max_position_embeddings = 2048 in its config.json; vLLM refuses a longer max_model_len): lower "
        "rollout.max_tokens to 2032 or less, or set model.max_position_embeddings (with model.rope_theta, as the "
        "paper does for Qwen2.5-Math)"
    ), lines[0]
    assert not (tmp_path / "toy").exists()  # nothing built


def test_the_reverse_task_is_graded_by_its_example_verifier():
    """toy.task reverse (configs/toy_reverse.yaml): four letters reversed, answered `answer: WORD`, which the
    example verifier reads and Math-Verify's extraction does not."""
    import sys
    from pathlib import Path

    from trapo.algorithm.rewards import extract_answer

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    try:
        from trapo.commands.toy_verifier import ReverseVerifier
    finally:
        sys.path.pop(0)
    pairs = toy._reversals(0)
    assert len(pairs) == 8**4 and len({q for q, _ in pairs}) == 8**4
    question, answer = pairs[0]
    word = question.removeprefix("reverse ").removesuffix(" =")
    assert answer == word[::-1] and set(word) <= set(toy.REVERSE_LETTERS)
    response = toy.response_text(answer, "reverse")
    v = ReverseVerifier()
    assert v.extract(response) == answer and extract_answer(response) is None
    assert v.equal(answer.lower(), answer) and v.key(answer.lower()) == v.key(answer)
    assert not v.equal(word, answer) or word == answer
    tok = toy._tokenizer([q + toy.response_text(a, "reverse") for q, a in pairs[:200]], letters=True)
    assert tok.tokenize(" ABCD") == ["Ġ", "A", "B", "C", "D"]  # one token per letter


def test_a_noisy_teacher_warm_start_learns_the_answer_distribution():
    """toy.sft_noise 0.4 with the decayed rate: the fit converges to the teacher's distribution, the right
    answer about 0.6 of the probability and the slip (a+b+10) about 0.4, so greedy decoding answers right."""
    import torch

    problems = [("12+34=", "46"), ("57+21=", "78"), ("33+44=", "77"), ("61+15=", "76")]
    tokenizer = toy._tokenizer([q + toy.response_text(a) for q, a in problems] + ["0123456789"])
    model = toy._model(tokenizer, 0)
    with torch.random.fork_rng():
        toy._warm_start(model, tokenizer, problems, 150, 0, "decay", noise=0.4)

    def chance(q, a):  # the model's probability of the whole response `\boxed{a}` then EOS
        p = tokenizer(q)["input_ids"]
        r = tokenizer(toy.response_text(a))["input_ids"] + [tokenizer.eos_token_id]
        with torch.no_grad():
            logp = model(input_ids=torch.tensor([p + r])).logits[0].log_softmax(-1)  # [T, V]
        return math.exp(sum(logp[len(p) - 1 + i, t].item() for i, t in enumerate(r)))

    for q, a in problems:
        right, slip = chance(q, a), chance(q, str(int(a) + toy.SLIP))
        assert 0.5 < right < 0.7 and 0.3 < slip < 0.5, (q, right, slip)  # greedy answers right
