"""Verifiable rewards: Math-Verify against a gold answer, and majority vote.

`math_reward` is the paper's binary reward R(tau, y) (section "Supervised
RLVR"); `majority_vote` gives the TTRL pseudo-label MAJ(a^1..a^G) and the
agreement indicator of eq. "unsupervised-method", which is also the
unlabeled pass rate of eq. "pass_rate".

Every comparison goes through `decide_pairs`: multiple-choice letters and
the exact fast paths of `answers.fast_equal` first, Math-Verify (in worker
processes, with a hard timeout) only for what they cannot settle.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from trapo.rewards.answers import (
    MAX_ANSWER_CHARS,
    choice_letter,
    extract_boxed,
    fast_equal,
    is_choice_gold,
    normalize,
)
from trapo.rewards.verifier import MathVerifier, default_verifier

DEFAULT_TIMEOUT = 5.0


def decide_pairs(
    pairs: Sequence[tuple[str, str]], timeout: float = DEFAULT_TIMEOUT, verifier: MathVerifier | None = None
) -> list[bool]:
    """gold == pred for each (gold, pred) answer-string pair (boxed contents).

    A single-letter gold A-J compares letters; two letter answers compare
    letters; a pred longer than MAX_ANSWER_CHARS is wrong. Never raises on
    content; each Math-Verify comparison is cut off after `timeout` seconds
    and counts as not equal.
    """
    out: list[bool | None] = []
    slow: list[tuple[str, str]] = []
    for gold, pred in pairs:
        if len(pred) > MAX_ANSWER_CHARS:
            decided = False
        elif is_choice_gold(gold):
            decided = choice_letter(pred) == gold.strip()
        elif (lg := choice_letter(gold)) is not None and (lp := choice_letter(pred)) is not None:
            decided = lg == lp
        else:
            decided = fast_equal(gold, pred)
        out.append(decided)
        if decided is None:
            slow.append((gold, pred))
    if slow:
        verdicts = iter((verifier or default_verifier()).equal_many(slow, timeout))
        out = [next(verdicts) if d is None else d for d in out]
    return [bool(d) for d in out]


def math_rewards(
    responses: Sequence[str],
    golds: Sequence[str],
    timeout: float = DEFAULT_TIMEOUT,
    verifier: MathVerifier | None = None,
) -> list[float]:
    """Batch form of `math_reward`: one Math-Verify round trip for the whole batch."""
    if len(responses) != len(golds):
        raise ValueError(f"math_rewards: {len(responses)} responses but {len(golds)} golds")
    preds = [extract_boxed(r) for r in responses]
    idx = [i for i, p in enumerate(preds) if p is not None]
    verdicts = decide_pairs([(golds[i], preds[i]) for i in idx], timeout, verifier)
    rewards = [0.0] * len(responses)
    for i, ok in zip(idx, verdicts):
        rewards[i] = 1.0 if ok else 0.0
    return rewards


def math_reward(response: str, gold: str, timeout: float = DEFAULT_TIMEOUT) -> float:
    """1.0 if the answer in the response's last \\boxed{} equals gold under Math-Verify, else 0.0.

    Multiple-choice golds (one letter A-J) compare letters. No box: 0.0.
    Never raises on any input, and a comparison that takes longer than
    `timeout` seconds scores 0.0, from any thread.
    """
    return math_rewards([response], [gold], timeout)[0]


def majority_votes(
    groups: Sequence[Sequence[str | None]], timeout: float = DEFAULT_TIMEOUT, verifier: MathVerifier | None = None
) -> list[tuple[str | None, list[bool]]]:
    """`majority_vote` for many questions at once, batching their comparisons.

    Clustering per group: distinct answers (after `normalize`) in order of
    count, then first appearance; each joins the first existing cluster whose
    representative (its first, most frequent member) it equals, else starts a
    new one. Round r compares every group's r-th distinct answer with that
    group's clusters, all groups in one batch, so only distinct strings are
    ever compared and at most G rounds are needed.
    """
    states = []
    for answers in groups:
        keys = [normalize(a) if a is not None and a.strip() and len(a) <= MAX_ANSWER_CHARS else None for a in answers]
        counts = Counter(k for k in keys if k is not None)
        first: dict[str, int] = {}
        for i, k in enumerate(keys):
            if k is not None:
                first.setdefault(k, i)
        order = sorted(counts, key=lambda k: (-counts[k], first[k]))
        raw = {k: answers[first[k]] for k in order}
        states.append({"keys": keys, "counts": counts, "order": order, "raw": raw, "clusters": []})

    for step in range(max((len(s["order"]) for s in states), default=0)):
        asks = []  # (state, key, pairs)
        for s in states:
            if step < len(s["order"]):
                key = s["order"][step]
                asks.append((s, key, [(s["raw"][c[0]], s["raw"][key]) for c in s["clusters"]]))
        verdicts = iter(decide_pairs([p for _, _, pairs in asks for p in pairs], timeout, verifier))
        for s, key, pairs in asks:
            hits = [next(verdicts) for _ in pairs]
            home = next((c for c, hit in zip(s["clusters"], hits) if hit), None)
            if home is None:
                s["clusters"].append([key])
            else:
                home.append(key)

    out = []
    for s in states:
        sizes = [sum(s["counts"][k] for k in c) for c in s["clusters"]]
        if not sizes or sizes.count(max(sizes)) > 1:
            out.append((None, [False] * len(s["keys"])))
            continue
        winner = s["clusters"][sizes.index(max(sizes))]
        members = set(winner)
        out.append((s["raw"][winner[0]], [k in members for k in s["keys"]]))
    return out


def majority_vote(answers: Sequence[str | None], timeout: float = DEFAULT_TIMEOUT) -> tuple[str | None, list[bool]]:
    """TTRL pseudo-label: the largest cluster of Math-Verify-equivalent answers.

    answers: extracted answers (None where a response had none) -> (label,
    agree) where label is the largest cluster's most frequent spelling and
    agree[i] says whether answers[i] is in that cluster. A tie for the
    largest cluster, or no answers at all, gives (None, all False), as the
    paper's public code does.
    """
    return majority_votes([answers], timeout)[0]
