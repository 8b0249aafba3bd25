"""One step's statistics, the metrics.jsonl file and the end-of-run summary.

A step's statistics are sums, computed on each rank from what it saw
(`step_sums`, pure), added over ranks once by name (`trapo.engine.dist.all_sum`),
and turned into the logged values (`step_values`, pure). Sums, never means,
cross ranks, so a rank with no unlabeled questions weighs nothing.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar


@dataclass
class StepTimer:
    """Seconds per phase of one step; a phase timed twice adds up. On a GPU also each phase's peak
    allocated device memory (bytes), for `trapo.commands.doctor` and `metrics.jsonl` (`peak_gb`)."""

    seconds: dict[str, float] = field(default_factory=dict)
    peak_bytes: dict[str, int] = field(default_factory=dict)
    # a measurement's hook around every phase: name -> context manager (`trapo gpu-bench` profiles through it)
    watch: ClassVar[Callable[[str], AbstractContextManager] | None] = None

    @contextmanager
    def time(self, name: str):
        import torch

        gpu = torch.cuda.is_available()
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with StepTimer.watch(name) if StepTimer.watch else nullcontext():
            yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        if gpu:
            self.peak_bytes[name] = max(self.peak_bytes.get(name, 0), torch.cuda.max_memory_allocated())


def cost_values(timer: StepTimer, response_tokens: float, moved: dict | None) -> dict:
    """metrics.jsonl's costs of a step: each phase's seconds, what moved to host memory for the rollouts and
    the copies' time (`moved`: `Policy.moved` when it offloads, else None), each phase's GPU peak, and the
    rollouts' tokens per second."""
    values: dict = {"timing": {name: round(sec, 4) for name, sec in timer.seconds.items()}}
    if moved is not None:
        values["offload"] = {"bytes": moved["bytes"], **{k: round(moved[k], 5) for k in ("offload_s", "reload_s")}}
    if timer.peak_bytes:  # GPU: each phase's peak allocated memory on this rank
        values["peak_gb"] = {name: round(b / 2**30, 3) for name, b in timer.peak_bytes.items()}
    values["tokens_per_s"] = response_tokens / max(timer.seconds["rollout"], 1e-9)
    return values


def step_sums(questions, grades, gate: list[float], rollouts) -> dict[str, float]:
    """This rank's sums over one step's questions (pure).

    questions: [b] `Question`; grades: `trapo.training.grading.Grades` of those
    questions; gate: [b] M per question (1 for labeled ones); rollouts: [b][G]
    `Rollout`. Pseudo-label precision counts only unlabeled questions whose
    hidden gold is known (pseudo_correct not NaN).
    """
    labeled_rates = [p for q, p in zip(questions, grades.pass_rates) if q.labeled]
    unlabeled = [
        (p, c, m) for q, p, c, m in zip(questions, grades.pass_rates, grades.pseudo_correct, gate) if not q.labeled
    ]
    known = [c for _, c, _ in unlabeled if not math.isnan(c)]
    responses = [r for group in rollouts for r in group]
    return {
        "labeled_questions": len(labeled_rates),
        "labeled_pass_sum": sum(labeled_rates),
        "unlabeled_questions": len(unlabeled),
        "unlabeled_pass_sum": sum(p for p, _, _ in unlabeled),
        # reward.unlabeled's rewards (the vote's, or a confidence score), each question's mean over its G
        "unlabeled_reward_sum": sum(sum(r) / len(r) for q, r in zip(questions, grades.rewards) if not q.labeled and r),
        "unlabeled_in_loss": sum(m for _, _, m in unlabeled),
        "pseudo_known": len(known),
        "pseudo_right": sum(known),
        "response_tokens": sum(len(r.token_ids) for r in responses),
        "truncated": sum(r.truncated for r in responses),
        "responses": len(responses),
        "grading_timeouts": grades.timeouts,
        "grading_budget_cut": grades.budget_cut,
        "grading_failed": grades.failed,
    }


def step_values(totals: dict[str, float], *, world: int, updates: int, applied: bool, unlabeled: bool) -> dict:
    """The logged values of one step from the sums over all ranks (pure).

    totals: `step_sums` plus the update sums of `trapo.engine.policy.UPDATE_SUMS`,
    each added over ranks and (update sums) over the step's `updates`
    optimizer steps. Each rank's loss is its share of the global loss times
    the world size (see the loss denominator), so the step's loss is the sum
    over ranks / world, averaged over updates. unlabeled: the run rewards unlabeled
    questions (`reward_unlabeled`, the mean of reward.unlabeled's rewards, is logged).
    """
    n_lab, n_unl = totals["labeled_questions"], totals["unlabeled_questions"]
    trained_tokens = max(totals["trained_tokens"], 1.0)
    lab_pass = totals["labeled_pass_sum"] / n_lab if n_lab else None
    unl_pass = totals["unlabeled_pass_sum"] / n_unl if n_unl else None
    return {
        "loss": totals["loss"] / world / updates if applied else float("nan"),
        "pg_loss": totals["pg_loss"] / world / updates,
        "entropy": totals["entropy"] / trained_tokens,
        "clip_frac": totals["clip_frac"] / trained_tokens,
        "trained_sequences": int(totals["trained_sequences"]),
        # mean |log pi_old - log pi_engine| per trained response token (a step that trains none: per token of
        # the answers trapo/training/update.py probes): ~0 when the engine runs the policy's weights, RoPE and
        # dtype at the same temperature; large after a missed push or a config slip
        "logprob_diff_rollout_vs_policy": (
            totals["logprob_diff"] / totals["logprob_tokens"] if totals["logprob_tokens"] else None
        ),
        # loss.rollout_is: mean importance weight (0 for dropped tokens), share of ratios above the cap
        "rollout_is_weight_mean": totals["is_weight"] / totals["is_tokens"] if totals["is_tokens"] else None,
        "rollout_is_capped_frac": totals["is_capped"] / totals["is_tokens"] if totals["is_tokens"] else None,
        # token_mask / sequence_mask: share of tokens dropped from the loss, share of sequences with a dropped
        # token (sequence_mask: the sequences dropped); 0 under truncate
        "rollout_is_masked_frac": totals["is_masked"] / totals["is_tokens"] if totals["is_tokens"] else None,
        "rollout_is_masked_seq_frac": totals["is_masked_seqs"] / totals["is_seqs"] if totals["is_seqs"] else None,
        # loss.overlong=soft_penalty: mean DAPO length penalty R_len (<= 0) added to a response's reward
        "overlong_penalty_mean": (
            totals["overlong_penalty"] / totals["overlong_responses"] if totals["overlong_responses"] else None
        ),
        # loss.beta > 0: mean k3 estimate of KL(pi_theta || pi_ref) per trained token
        "kl_ref": totals["kl_ref"] / totals["kl_tokens"] if totals["kl_tokens"] else None,
        "labeled_questions": int(n_lab),
        "unlabeled_questions": int(n_unl),
        "reward_labeled": lab_pass,
        "pass_rate_labeled": lab_pass,
        "pass_rate_unlabeled": unl_pass,
        "reward_unlabeled": totals["unlabeled_reward_sum"] / n_unl if unlabeled and n_unl else None,
        "unlabeled_in_loss": int(totals["unlabeled_in_loss"]),
        "pseudo_label_precision": totals["pseudo_right"] / totals["pseudo_known"] if totals["pseudo_known"] else None,
        "response_tokens": int(totals["response_tokens"]),
        "responses": int(totals["responses"]),
        "truncated_frac": totals["truncated"] / totals["responses"],
        "grading_timeouts": int(totals["grading_timeouts"]),  # Math-Verify comparisons that hit reward.timeout
        "grading_budget_cut": int(totals["grading_budget_cut"]),  # left undecided: reward.step_budget spent
        "grading_failed": int(totals["grading_failed"]),  # left undecided: grading processes died on them
        "skipped": not applied,
    }


def dynamic_sampling_values(rolled_out: int, informative: int, kept: int, rounds: int) -> dict[str, int]:
    """metrics.jsonl's `dynamic_sampling` block of one step, counts over all ranks (pure; trapo/training/sampling.py).

    rolled_out: groups (questions) rolled out in the step's `rounds` generation rounds; informative: those
    whose rewards were not all equal; kept: the informative ones the update trained on (at most
    train.rollout_batch_size, fewer when the round limit or the epoch's end came first).
    """
    return {
        "rounds": rounds,
        "extra_rounds": rounds - 1,  # refills: batches rolled out beyond the step's first
        "groups_rolled_out": rolled_out,
        "groups_filtered": rolled_out - informative,  # equal rewards (all right or all wrong): no signal
        "groups_kept": kept,
        "groups_surplus": informative - kept,  # informative, beyond the batch size: dropped
    }


TRUNCATION_WARNING = 0.2  # share of responses cut at rollout.max_tokens
TIMEOUT_STORM = 0.05  # grading timeouts per response


def step_warnings(step_log: dict) -> list[tuple[str, str]]:
    """(kind, message) of what in one step's values a user must see on the terminal (pure)."""
    out = []
    if step_log["truncated_frac"] > TRUNCATION_WARNING:
        out.append(
            (
                "truncation",
                f"{step_log['truncated_frac']:.0%} of responses hit rollout.max_tokens at step {step_log['step']}; "
                "their answers are cut off and usually graded wrong (raise rollout.max_tokens)",
            )
        )
    timeouts, cut = step_log["grading_timeouts"], step_log["grading_budget_cut"]
    if cut or timeouts > TIMEOUT_STORM * step_log["responses"]:
        out.append(
            (
                "grading",
                f"step {step_log['step']}: {timeouts} Math-Verify timeouts and {cut} comparisons cut by "
                "reward.step_budget (degenerate answers?); they count as wrong, see grading_* in metrics.jsonl",
            )
        )
    if step_log.get("grading_failed"):
        out.append(
            (
                "grading_failed",
                f"step {step_log['step']}: {step_log['grading_failed']} comparisons undecided because Math-Verify "
                "processes died on them twice (out of memory?); they count as wrong, see grading_failed",
            )
        )
    return out


def progress_fields(step_log: dict, selection: dict | None) -> dict[str, str | int]:
    """The progress bar's postfix: labeled reward, unlabeled pass rate, unlabeled questions selected."""
    return {
        "r_lab": fmt(step_log.get("reward_labeled")),
        "p_unl": fmt(step_log.get("pass_rate_unlabeled")),
        "sel": (selection or {}).get("selected", 0),
    }


# ----------------------------------------------------------------------------- files and text


def append_jsonl(path: Path, row: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def trim_metrics(path: Path, step: int) -> None:
    """On resume, move the rows of steps after the checkpoint (they are redone) from a log with a `step` per row
    (metrics.jsonl, labels.jsonl) to <name>.discarded.jsonl."""
    if not path.is_file():
        return
    keep, drop = [], []
    for line in path.read_text().splitlines():
        try:
            (keep if json.loads(line)["step"] <= step else drop).append(line)
        except (json.JSONDecodeError, KeyError):
            drop.append(line)
    if drop:
        with open(path.with_suffix(".discarded.jsonl"), "a") as f:
            f.write("".join(line + "\n" for line in drop))
    path.write_text("".join(line + "\n" for line in keep))


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def run_summary(
    steps: int,
    before: dict | None,
    after: dict | None,
    selection: dict | None,
    best: dict | None,
    *,
    temperature: float | None = None,
    avg: dict | None = None,
    cpu_kernels: str | None = None,
):
    """summary.json: held-out scores before / after training (`Evaluator.heldout`, at `temperature`), the last
    epoch end's selection diagnostics and the best validation checkpoint. avg: {"k", "temperature", "before",
    "after"} of `Evaluator.heldout_avg` (eval.heldout_k > 0). cpu_kernels: torch's CPU kernel set (AVX2,
    AVX512, ...), which the toy's figures depend on."""
    out = {
        "steps": steps,
        "heldout_accuracy_before": before and before["mean"],
        "heldout_accuracy_after": after and after["mean"],
        "heldout_before": before,
        "heldout_after": after,
        "heldout_temperature": temperature,
        "selection": selection,
        "best": best,
        "cpu_kernels": cpu_kernels,
    }
    if avg:
        out["heldout_avg"] = avg
        out["heldout_avg_before"] = avg["before"] and avg["before"]["mean"]
        out["heldout_avg_after"] = avg["after"] and avg["after"]["mean"]
    return out


def _before_after(name: str, before: float | None, after: float | None) -> list[str]:
    """`name: 0.500 before -> 0.625 after`, or `name after: 0.625` without a before (a resumed old run)."""
    if before is not None:
        return [f"{name}: {before:.3f} before -> {after:.3f} after"]
    return [f"{name} after: {after:.3f}"] if after is not None else []


def summary_text(summary: dict) -> str:
    """The lines printed at the end of a run."""
    sel = summary.get("selection") or {}
    lines = [f"trained {summary['steps']} steps"]
    t = summary.get("heldout_temperature")  # absent from the summaries of older runs
    label = "held-out accuracy" + ("" if t is None else " (greedy)" if t == 0 else f" (temperature {t:g})")
    lines += _before_after(label, summary.get("heldout_accuracy_before"), summary.get("heldout_accuracy_after"))
    avg = summary.get("heldout_avg")
    if avg:
        name = f"held-out avg@{avg['k']} (temperature {avg['temperature']:g})"
        lines += _before_after(name, summary.get("heldout_avg_before"), summary.get("heldout_avg_after"))
    if sel:
        lines.append(
            f"unlabeled selected at the last epoch end: {sel['selected']} of {sel['unlabeled']} "
            f"(database {sel['database']})"
        )
        lines.append(
            f"pseudo-label precision: selected {fmt(sel.get('precision_selected'))}, "
            f"rejected {fmt(sel.get('precision_rejected'))}"
        )
    return "\n".join(lines)
