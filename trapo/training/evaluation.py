"""The evaluation loop that validation during training and `python -m trapo eval` share: generate with a
rollout engine, grade every response against its gold, score each benchmark (avg@n).

    results, grades = evaluate(engine, tokenizer, benchmarks, n_for=..., temperature=..., ...)
    scores = pooled_scores(engine, tokenizer, benchmarks, shard=rank, shards=world, gather=..., ...)
    evaluator = Evaluator(cfg, rollout, policy, tokenizer, verifier, ...)   # the trainer's benchmarks
    evaluator.heldout(), evaluator.validation()

Requests are seeded per (benchmark, question), so a score does not depend on how the questions were
split over ranks or chunks.
"""

from __future__ import annotations

import time

from trapo.algorithm.pass_at_k import avg_at_k
from trapo.algorithm.rewards import Judge, answer_rewards
from trapo.algorithm.rewards.verifiers import extract_answers
from trapo.config import Config
from trapo.data import Benchmark, gold_problem, tokenize_prompts
from trapo.engine import dist
from trapo.engine.grading.verifier import default_verifier
from trapo.engine.rollout import request_seed


def grade_responses(texts: list[str], gold: str, timeout: float = 5.0, verifier: Judge | None = None) -> list[dict]:
    """Per response: extracted answer and grade (`math_rewards`: Math-Verify, the process-wide one where
    `verifier` is None, a letter gold compares letters; or the task verifier `verifier` runs, `reward.verifier`)."""
    judge = default_verifier() if verifier is None else verifier
    answers, _ = extract_answers(texts, judge, timeout)  # once: graded and kept
    rewards = answer_rewards(answers, [gold] * len(texts), judge, timeout)
    return [{"answer": a, "correct": r == 1.0} for a, r in zip(answers, rewards)]


def ungradable_golds(benchmarks: list[Benchmark]) -> list[str]:
    """One warning per benchmark file holding questions whose gold is empty or prose (`gold_problem`, the
    check training refuses such rows by): how many, and the first one's row and gold. A prose gold matches
    only a response that repeats it word for word, so its question scores 0 (nearly) always."""
    bad: dict[str, list] = {}
    total: dict[str, int] = {}
    for b in benchmarks:
        total[b.source] = total.get(b.source, 0) + len(b.questions)
        for q in b.questions:
            why = gold_problem(q.answer)
            if why:
                bad.setdefault(b.source, []).append((q, why))
    lines = []
    for source, found in bad.items():
        q, why = found[0][0], " or ".join(sorted({w for _, w in found}))
        gold = q.answer if len(q.answer or "") <= 60 else q.answer[:57] + "..."
        lines.append(
            f"{source}: {len(found)} of {total[source]} questions have a gold that is {why}, not a math answer "
            f"or an option letter (first: {q.where}, {gold!r}); they score 0 unless a response repeats the gold "
            f"verbatim: fix or remove those rows"
        )
    return lines


def pending_prompts(
    tokenizer,
    benchmarks: list[Benchmark],
    *,
    template: str,
    max_prompt_tokens: int | None,
    done: dict | None = None,
    key: str = "data.max_prompt_tokens",
) -> dict[str, list[list[int]]]:
    """Per benchmark, the prompt ids of its questions not in `done`, in order; every prompt is checked (a
    length over `max_prompt_tokens`, None: no cap, is a DataError naming `key`) before any generation starts."""
    done = done or {}
    todo = {b.name: [q for q in b.questions if (b.name, q.uid) not in done] for b in benchmarks}
    return {name: tokenize_prompts(qs, template, tokenizer, max_prompt_tokens, key) for name, qs in todo.items()}


def evaluate(
    engine,
    tokenizer,
    benchmarks: list[Benchmark],
    *,
    n_for,
    temperature: float,
    max_tokens: int,
    template: str,
    max_prompt_tokens: int | None,
    seed: int = 0,
    done: dict | None = None,
    on_question=None,
    chunk: int = 64,
    verifier=None,
    prompts: dict[str, list[list[int]]] | None = None,
) -> tuple[dict, dict]:
    """Generate, grade and score; returns (results per benchmark, grades per benchmark).

    grades[name]: [questions][n] correct flags, for metrics a caller adds (pass@k,
    or scores pooled over ranks).
    n_for(name) -> samples per question. `done` maps (benchmark, uid) to a
    finished question's record (from samples.jsonl) that is reused as is;
    `on_question(record)` is called once per newly finished question, in
    chunks of `chunk` questions, so a caller can persist progress.
    `prompts`: what `pending_prompts` returned for these benchmarks and `done`, when the caller
    tokenized them already (`trapo eval` sizes its engine by the longest).
    """
    done = done or {}
    todo = {b.name: [q for q in b.questions if (b.name, q.uid) not in done] for b in benchmarks}
    if prompts is None:
        prompts = pending_prompts(
            tokenizer, benchmarks, template=template, max_prompt_tokens=max_prompt_tokens, done=done
        )
    results, grades_by_name = {}, {}
    for bench in benchmarks:
        n = n_for(bench.name)
        started = time.perf_counter()
        records = [done[(bench.name, q.uid)] for q in bench.questions if (bench.name, q.uid) in done]
        todo_b, prompts_b = todo[bench.name], prompts[bench.name]
        for start in range(0, len(todo_b), chunk):
            part = todo_b[start : start + chunk]
            outs = engine.generate(
                prompts_b[start : start + chunk],
                n=n,
                temperature=temperature,
                max_tokens=max_tokens,
                seeds=[request_seed(seed, bench.name, q.uid) for q in part] if temperature > 0 else None,
            )
            for q, group in zip(part, outs):
                grades = grade_responses([r.text for r in group], q.answer, verifier=verifier)
                rec = {
                    "benchmark": bench.name,
                    "id": q.uid,
                    "question": q.question,
                    "gold": q.answer,
                    "responses": [
                        {"text": r.text, "tokens": len(r.token_ids), "truncated": r.truncated, **g}
                        for r, g in zip(group, grades)
                    ],
                }
                records.append(rec)
                if on_question:
                    on_question(rec)
        grades = [[r["correct"] for r in rec["responses"]] for rec in records]
        tokens = [r["tokens"] for rec in records for r in rec["responses"]]
        metrics = {f"avg@{n}": avg_at_k(grades)}
        if n == 1:
            metrics["pass@1"] = metrics["avg@1"]
        grades_by_name[bench.name] = grades
        results[bench.name] = {
            "questions": len(records),
            "samples": n,
            "metrics": metrics,
            "score": metrics[f"avg@{n}"],
            "tokens_generated": sum(tokens),
            "mean_response_length": sum(tokens) / len(tokens) if tokens else 0.0,
            "seconds": round(time.perf_counter() - started, 3),
            "source": bench.source,
        }
    return results, grades_by_name


def pooled_scores(engine, tokenizer, benchmarks: list[Benchmark], *, shard: int, shards: int, gather, **kwargs):
    """avg@n per benchmark and their mean over `shards` evaluators, or None without benchmarks.

    This one evaluates every `shards`-th question from `shard` (`evaluate` with
    `kwargs`); `gather(grades)` returns every shard's grades (a collective across
    processes, or `lambda g: [g]` alone).
    """
    if not benchmarks:
        return None
    mine = [Benchmark(b.name, b.questions[shard::shards], b.source) for b in benchmarks]
    _, grades = evaluate(engine, tokenizer, mine, **kwargs)
    everyone = gather(grades)
    scores = {name: avg_at_k([g for part in everyone for g in part[name]]) for name in grades}
    return {**scores, "mean": sum(scores.values()) / len(scores)}


class Evaluator:
    """The trainer's benchmarks scored with its own rollout engine: held-out pass@1 (data.test_files) before
    and after training, with eval.heldout_k > 0 also their avg@k at eval.temperature, and validation
    avg@eval.n (eval.files) for checkpoint selection.

    `turn()` is the trainer's generation turn (a context manager: offload, gather or wake, then restore).
    """

    def __init__(
        self,
        cfg: Config,
        rollout,
        policy,
        tokenizer,
        verifier,
        *,
        rank: int,
        world: int,
        turn,
        test: list[Benchmark],
        validation: list[Benchmark],
    ):
        self.cfg, self.rollout, self.policy, self.tokenizer, self.verifier = cfg, rollout, policy, tokenizer, verifier
        self.rank, self.world, self.turn = rank, world, turn
        self.test_benchmarks, self.val_benchmarks = test, validation

    def heldout(self) -> dict | None:
        """pass@1 per test benchmark and their mean, at rollout.eval_temperature (greedy by default)."""
        r = self.cfg.rollout
        return self.scores(self.test_benchmarks, 1, r.eval_temperature, r.max_tokens)

    def heldout_avg(self) -> dict | None:
        """avg@eval.heldout_k per test benchmark and their mean at eval.temperature (the paper's protocol), or
        None when eval.heldout_k is 0."""
        k = self.cfg.eval.heldout_k
        return (
            self.scores(self.test_benchmarks, k, self.cfg.eval.temperature, self.cfg.rollout.max_tokens) if k else None
        )

    def validation(self) -> dict | None:
        """avg@eval.n per validation benchmark and their mean, at eval.temperature."""
        e = self.cfg.eval
        return self.scores(self.val_benchmarks, e.n, e.temperature, e.max_tokens or self.cfg.rollout.max_tokens)

    def scores(self, benchmarks: list[Benchmark], n: int, temperature: float, max_tokens: int) -> dict | None:
        """avg@n per benchmark and their mean, pooled over all engines (each evaluates every k-th question)."""
        if not benchmarks:
            return None
        tp = self.cfg.rollout.tensor_parallel_size  # the ranks of a tensor-parallel group share an engine
        with self.turn():
            scores = pooled_scores(
                self.rollout,
                self.tokenizer,
                benchmarks,
                shard=self.rank // tp,
                shards=self.world // tp,
                gather=lambda grades: dist.all_gather(grades)[::tp],
                n_for=lambda _: n,
                temperature=temperature,
                max_tokens=max_tokens,
                template=self.cfg.data.prompt_template,
                max_prompt_tokens=self.cfg.data.max_prompt_tokens,
                seed=self.cfg.seed,
                verifier=self.verifier,
            )
        if self.rollout.weights_asleep:  # GPU: the turn ended in a level-2 sleep; the next rollouts need weights
            self.rollout.push_weights(self.policy.full_weights())
        return scores
