"""Verifiable rewards: Math-Verify against a gold answer, and majority vote.

`math_reward` is the paper's binary reward R(tau, y) (section "Supervised
RLVR"); `majority_vote` gives the TTRL pseudo-label MAJ(a^1..a^G) and the
agreement indicator of eq. "unsupervised-method", which is also the
unlabeled pass rate of eq. "pass_rate".

Every comparison goes through `judge_pairs`: multiple-choice letters and
the exact fast paths of `answers.fast_equal` first, the `Judge` the caller
passes (Math-Verify in worker processes, with a hard timeout) only for what
they cannot settle. A `deadline` (the step's grading budget) bounds it all:
once it has passed, what the fast paths cannot settle counts as not equal,
unsent. A `Tally` counts what timed out or was cut, for the step's metrics.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import combinations

from trapo.algorithm.rewards.answers import (
    MAX_ANSWER_CHARS,
    choice_letter,
    fast_equal,
    is_choice_gold,
    normalize,
    values_differ,
)
from trapo.algorithm.rewards.extraction import extract_answer
from trapo.algorithm.rewards.judge import Judge, Verdict

DEFAULT_TIMEOUT = 5.0


@dataclass
class Tally:
    """Comparisons not decided on their merits, summed over calls (one grading step, say).

    timeouts: comparisons, and answers parsed ahead of a vote, that exhausted
    the per-comparison timeout (now, or for the same answer earlier: those
    are answered at once); budget_cut: comparisons left undecided because the
    grading budget was spent; failed: comparisons left undecided because grading
    processes died on them (Verdict.FAILED), and a task verifier's calls
    that raised (ERROR). All count as "not equal".
    """

    timeouts: int = 0
    budget_cut: int = 0
    failed: int = 0

    def add(self, verdicts: Sequence[Verdict]) -> None:
        self.timeouts += sum(v.timed_out for v in verdicts)
        self.budget_cut += sum(v is Verdict.CUT for v in verdicts)
        self.failed += sum(v in (Verdict.FAILED, Verdict.ERROR) for v in verdicts)


def fast_verdict(gold: str, pred: str) -> bool | None:
    """gold == pred where that is certain without Math-Verify; None where it is not.

    A single-letter gold A-J compares letters; two letter answers compare
    letters; a pred longer than MAX_ANSWER_CHARS is wrong; else `fast_equal`.
    """
    if len(pred) > MAX_ANSWER_CHARS:
        return False
    if is_choice_gold(gold):
        return choice_letter(pred) == gold.strip()
    if (lg := choice_letter(gold)) is not None and (lp := choice_letter(pred)) is not None:
        return lg == lp
    return fast_equal(gold, pred)


def judge_pairs(
    pairs: Sequence[tuple[str, str]],
    judge: Judge,
    timeout: float = DEFAULT_TIMEOUT,
    deadline: float | None = None,
) -> list[Verdict]:
    """A Verdict for each (gold, pred) answer-string pair (boxed contents): `fast_verdict`, else `judge`.

    Never raises on content. A Math-Verify comparison is cut off after
    `timeout` seconds (a TIMEOUT verdict, blamed on the pair or on the answer
    being parsed); after `deadline` (a `time.monotonic()` value) nothing is
    sent and the rest is CUT. A task verifier's judge (`judge.spec`, `reward.verifier`) decides every pair
    itself, in its workers: no math fast path.
    """
    if judge.spec != "math":
        return judge.judge_many(pairs, timeout, deadline)
    out: list[Verdict | None] = []
    slow: list[tuple[str, str]] = []
    for gold, pred in pairs:
        decided = fast_verdict(gold, pred)
        out.append(None if decided is None else Verdict.EQUAL if decided else Verdict.NOT_EQUAL)
        if decided is None:
            slow.append((gold, pred))
    if slow:
        verdicts = iter(judge.judge_many(slow, timeout, deadline))
        out = [next(verdicts) if v is None else v for v in out]
    return out


def decide_pairs(
    pairs: Sequence[tuple[str, str]],
    judge: Judge,
    timeout: float = DEFAULT_TIMEOUT,
    deadline: float | None = None,
    tally: Tally | None = None,
) -> list[bool]:
    """gold == pred for each (gold, pred) answer-string pair: `judge_pairs` as booleans.

    A comparison that timed out, or was cut by the deadline, is not equal
    (and counted in `tally`).
    """
    verdicts = judge_pairs(pairs, judge, timeout, deadline)
    if tally is not None:
        tally.add(verdicts)
    return [v is Verdict.EQUAL for v in verdicts]


def math_rewards(
    responses: Sequence[str],
    golds: Sequence[str],
    judge: Judge,
    timeout: float = DEFAULT_TIMEOUT,
    deadline: float | None = None,
    tally: Tally | None = None,
) -> list[float]:
    """Batch form of `math_reward`: one Math-Verify round trip for the whole batch."""
    if len(responses) != len(golds):
        raise ValueError(f"math_rewards: {len(responses)} responses but {len(golds)} golds")
    return answer_rewards([extract_answer(r) for r in responses], golds, judge, timeout, deadline, tally)


def answer_rewards(
    answers: Sequence[str | None],
    golds: Sequence[str],
    judge: Judge,
    timeout: float = DEFAULT_TIMEOUT,
    deadline: float | None = None,
    tally: Tally | None = None,
) -> list[float]:
    """`math_rewards` on answers already extracted (`extract_answer`; None: no answer, reward 0.0), for
    callers that also keep the answers (the trainer's grading, the evaluation's samples)."""
    if len(answers) != len(golds):
        raise ValueError(f"answer_rewards: {len(answers)} answers but {len(golds)} golds")
    idx = [i for i, a in enumerate(answers) if a is not None]
    verdicts = decide_pairs([(golds[i], answers[i]) for i in idx], judge, timeout, deadline, tally)
    rewards = [0.0] * len(answers)
    for i, ok in zip(idx, verdicts):
        rewards[i] = 1.0 if ok else 0.0
    return rewards


def math_reward(response: str, gold: str, judge: Judge, timeout: float = DEFAULT_TIMEOUT) -> float:
    """1.0 if the response's answer (`extract_answer`: what Math-Verify reads in it) equals gold, else 0.0.

    Multiple-choice golds (one letter A-J) compare letters. No answer (no box, no stated final answer): 0.0.
    Never raises on any input, and with Math-Verify's judge (`MathVerifier`) a comparison that takes longer
    than `timeout` seconds scores 0.0, from any thread.
    """
    return math_rewards([response], [gold], judge, timeout)[0]


@dataclass
class _Ballot:
    """One question's answers, as the vote sees them, and where its clustering stands."""

    keys: list  # per response: its answer after `normalize` (a task verifier: its key); None without one
    counts: Counter  # key -> responses with it
    order: list[str]  # distinct keys, most frequent first, then first appearance
    raw: dict[str, str]  # key -> its first spelling: what is compared, and returned as the label
    clusters: list[list[str]] = field(default_factory=list)  # keys; the first is the representative
    frozen: set[str] = field(default_factory=set)  # keys that exhausted the timeout: never compared again
    values: dict[str, object] = field(default_factory=dict)  # key -> its probe value (complex or mpmath), if any
    met: dict[str, set[str]] = field(default_factory=dict)  # key not yet placed -> representatives it differs from
    strikes: Counter = field(default_factory=Counter)  # key -> its comparisons that timed out, blamed elsewhere
    placed: set[str] = field(default_factory=set)  # keys in a cluster
    turn: int = 0  # keys of `order` before it are placed

    def live(self) -> list[list[str]]:
        """Clusters a key is still compared with: those whose representative is not frozen."""
        return [c for c in self.clusters if c[0] not in self.frozen]

    def open_keys(self) -> list[str]:
        """Keys not yet placed, in order."""
        return [k for k in self.order[self.turn :] if k not in self.placed]

    def unmet(self, key: str) -> list[str]:
        """The live representatives `key` is still to be compared with (none once it is frozen)."""
        if key in self.frozen:
            return []
        met = self.met.get(key, ())
        return [c[0] for c in self.live() if c[0] not in met]

    def asks(self) -> list[tuple[str, list[str]]]:
        """This round's comparisons: each open key with the live representatives it has not met, in cluster
        order. An answer past float range goes into one comparison its value cannot settle per round: any may
        time out (Math-Verify working the number out), and then it is frozen and no other waits on it. A key
        stops at the first representative it must wait for, so that it still joins the first it equals."""
        trying: set[str] = set()
        out = []
        for key in self.open_keys():
            reps = []
            for rep in self.unmet(key):
                risky = self.risky(rep, key)
                if not trying.isdisjoint(risky):
                    break
                trying |= risky
                reps.append(rep)
            if reps:
                out.append((key, reps))
        return out

    def risky(self, rep: str, key: str) -> set[str]:
        """Of `rep` and `key`, the answers past float range, where their values cannot settle the comparison."""
        a, b = self.values.get(rep), self.values.get(key)
        if values_differ(a, b):
            return set()
        return {k for k, v in ((rep, a), (key, b)) if _astronomical(v)}

    def advance(self) -> None:
        """Place keys in order while their place is known: a frozen key alone; a key that differs from every
        live representative starts a cluster (the clusters after it will be compared with it)."""
        while self.turn < len(self.order):
            key = self.order[self.turn]
            if key not in self.placed:
                if self.unmet(key):
                    return  # comparisons still to come
                self.clusters.append([key])
                self.placed.add(key)
            self.turn += 1

    def settle(self, key: str, reps: list[str], verdicts: list[Verdict]) -> None:
        """Take `key`'s verdicts against the representatives `reps` (in cluster order). It joins the first it
        equals. A timeout blamed on a representative (`_blame`) freezes it; one blamed on `key`, or a second
        timeout of `key` wherever blamed (each costs a timeout, whoever is slow), freezes `key`, alone. What is
        left differs: `advance` places the key once it has met every live representative."""
        for rep, v in zip(reps, verdicts):
            if v.timed_out:
                blamed = _blame(self, rep, key, v)
                self.frozen.add(blamed)
                self.strikes[key] += blamed == rep
        home = next((r for r, v in zip(reps, verdicts) if v is Verdict.EQUAL), None)
        if home is not None:
            self.frozen.discard(key)  # found its cluster: a timeout elsewhere does not matter
            next(c for c in self.clusters if c[0] == home).append(key)
            self.placed.add(key)
        elif self.strikes[key] >= 2:
            self.frozen.add(key)  # placed alone by `advance`, at its turn
        elif key not in self.frozen:
            self.met.setdefault(key, set()).update(reps)


def _blame(ballot: _Ballot, rep: str, key: str, verdict: Verdict) -> str:
    """The answer a timed-out comparison of representative `rep` with `key` is blamed on (and frozen).

    Parsing: the answer being parsed. Comparing two parsed answers: the one whose probe value is past float
    range where only one is (Math-Verify works such numbers out exactly: sympy's (10^{100})! beside `a+b`),
    else the newcomer, `key`. So a heavy representative is frozen after one round, not met by every later key.
    """
    if verdict is Verdict.GOLD_TIMEOUT:
        return rep
    if verdict is Verdict.TIMEOUT and _astronomical(ballot.values.get(rep)) > _astronomical(ballot.values.get(key)):
        return rep
    return key


def _astronomical(value) -> bool:
    """A probe value past float range (an mpmath number; complex ones are in range)."""
    return value is not None and not isinstance(value, complex)


def _ballot(answers: Sequence[str | None], keys: Sequence | None = None) -> _Ballot:
    if keys is None:
        keys = [normalize(a) if a is not None and a.strip() and len(a) <= MAX_ANSWER_CHARS else None for a in answers]
    else:  # a task verifier's keys: every answer it extracted is one
        keys = [None if a is None else k for a, k in zip(answers, keys)]
    counts = Counter(k for k in keys if k is not None)
    first: dict[str, int] = {}
    for i, k in enumerate(keys):
        if k is not None:
            first.setdefault(k, i)
    order = sorted(counts, key=lambda k: (-counts[k], first[k]))
    return _Ballot(keys, counts, order, {k: answers[first[k]] for k in order})


def _hard_keys(ballot: _Ballot) -> list[str]:
    """Keys that some comparison of this vote may send to Math-Verify (the fast paths cannot settle them).

    Pairs are (earlier, later) in vote order, as the vote compares them.
    """
    hard: set[str] = set()
    for a, b in combinations(ballot.order, 2):
        if (a not in hard or b not in hard) and fast_verdict(ballot.raw[a], ballot.raw[b]) is None:
            hard.update((a, b))
    return [k for k in ballot.order if k in hard]


def _freeze_slow_answers(ballots, judge: Judge, timeout, deadline, tally) -> None:
    """Parse every answer that needs Math-Verify once, all questions side by side, before any comparison.

    An answer whose parsing exhausts the timeout is frozen: it stays its own
    cluster and is never compared, so a question with G such answers costs
    about one timeout in all rather than one per comparison. Its parse comes
    back only as a verdict: nothing changes when nothing times out.
    """
    hard = [_hard_keys(b) for b in ballots]
    if not any(hard):
        return
    verdicts, values = judge.prepare_many(
        [[b.raw[k] for k in keys] for b, keys in zip(ballots, hard)], timeout, deadline
    )
    for b, keys, vs in zip(ballots, hard, verdicts):
        b.frozen.update(k for k, v in zip(keys, vs) if v.timed_out)
        b.values.update((k, values[b.raw[k]]) for k in keys if b.raw[k] in values)
        if tally is not None:
            tally.timeouts += sum(v.timed_out for v in vs)


def _judge_round(asks, judge: Judge, timeout, deadline) -> list[Verdict]:
    """The verdicts of one round's comparisons, (ballot, key, representatives) each, in order. A pair whose
    probe values (from the parse ahead) differ is not equal, settled here, as the executor would
    (`answers.values_differ`): only the rest is sent."""
    pairs = [(b, rep, key) for b, key, reps in asks for rep in reps]
    differ = [values_differ(b.values.get(rep), b.values.get(key)) for b, rep, key in pairs]
    asked = [(b.raw[rep], b.raw[key]) for (b, rep, key), known in zip(pairs, differ) if not known]
    sent = iter(judge_pairs(asked, judge, timeout, deadline))
    return [Verdict.NOT_EQUAL if known else next(sent) for known in differ]


@dataclass(frozen=True)
class Vote:
    """One question's vote: the majority `label` (None on a tie for the largest cluster, or with no answers),
    which responses `agree` with it, each response's `share`, the fraction of the G responses in its
    cluster (0.0 without an answer): EMPO's reward, p(cluster | question) (arXiv 2504.05812), and each
    response's `cluster`, its cluster's index (clusters in the order they were started: the most frequent
    answer's first), None without an answer."""

    label: str | None
    agree: list[bool]
    share: list[float]
    cluster: list[int | None]

    def sizes(self) -> list[int]:
        """Responses per cluster, by cluster index."""
        counts = Counter(c for c in self.cluster if c is not None)
        return [counts[i] for i in range(len(counts))]


def _outcome(ballot: _Ballot) -> Vote:
    sizes = [sum(ballot.counts[k] for k in c) for c in ballot.clusters]
    size_of = {k: size for c, size in zip(ballot.clusters, sizes) for k in c}
    share = [size_of[k] / len(ballot.keys) if k is not None else 0.0 for k in ballot.keys]
    index = {k: i for i, c in enumerate(ballot.clusters) for k in c}
    cluster = [None if k is None else index[k] for k in ballot.keys]
    if not sizes or sizes.count(max(sizes)) > 1:
        return Vote(None, [False] * len(ballot.keys), share, cluster)
    winner = ballot.clusters[sizes.index(max(sizes))]
    members = set(winner)
    return Vote(ballot.raw[winner[0]], [k in members for k in ballot.keys], share, cluster)


def majority_votes(
    groups: Sequence[Sequence[str | None]],
    judge: Judge,
    timeout: float = DEFAULT_TIMEOUT,
    deadline: float | None = None,
    tally: Tally | None = None,
    keys: Sequence[Sequence] | None = None,
) -> list[tuple[str | None, list[bool]]]:
    """`majority_vote` for many questions at once, batching their comparisons: `cluster_votes`' labels and
    agreement."""
    return [(v.label, v.agree) for v in cluster_votes(groups, judge, timeout, deadline, tally, keys)]


def cluster_votes(
    groups: Sequence[Sequence[str | None]],
    judge: Judge,
    timeout: float = DEFAULT_TIMEOUT,
    deadline: float | None = None,
    tally: Tally | None = None,
    keys: Sequence[Sequence] | None = None,
) -> list[Vote]:
    """Each group's answers clustered by equivalence, many questions at once, batching their comparisons: a
    `Vote` per group.

    Clustering per group: distinct answers (after `normalize`; identical
    strings are one answer, never compared) in order of count, then first
    appearance; each joins the first cluster whose representative (its first,
    most frequent member) it equals, else starts a new one.

    Each round sends, for every group at once, the comparisons of each answer
    not yet placed with every cluster it has not met: the later answers meet
    a new representative in the round after it starts its cluster, side by
    side, not one round each, so the slow comparisons of a round cost one
    timeout together. An answer whose value is past float range takes part
    in one comparison its value cannot settle per round (`_Ballot.asks`).

    Degenerate answers cannot stall it: the answers that need Math-Verify are
    parsed once, side by side, before round 1; an answer that exhausts the
    timeout (parsing, or a comparison blamed on it: `_blame`) is frozen,
    alone, never compared again; after `deadline` the comparisons left count
    as not equal, unsent. `tally` counts both. Without timeouts the result is
    the plain clustering above.

    keys: per group, each answer's key from a task verifier (`verifiers.extract_answers`): answers with
    equal keys are one answer (the key wins over `equal`), which is asked only across keys.
    """
    task = judge.spec != "math"
    ballots = [_ballot(answers, None if keys is None else keys[g]) for g, answers in enumerate(groups)]
    if not task:  # a task verifier has nothing to parse ahead
        _freeze_slow_answers(ballots, judge, timeout, deadline, tally)
    while True:
        asks = []  # (ballot, key, representatives it has not met, in cluster order)
        for b in ballots:
            b.advance()
            asks += [(b, key, reps) for key, reps in b.asks()]
        if not asks:
            return [_outcome(b) for b in ballots]
        verdicts = iter(_judge_round(asks, judge, timeout, deadline))
        for b, key, reps in asks:
            mine = [next(verdicts) for _ in reps]
            if tally is not None:
                tally.add(mine)
            b.settle(key, reps, mine)


def majority_vote(
    answers: Sequence[str | None], judge: Judge, timeout: float = DEFAULT_TIMEOUT
) -> tuple[str | None, list[bool]]:
    """TTRL pseudo-label: the largest cluster of Math-Verify-equivalent answers.

    answers: extracted answers (None where a response had none) -> (label,
    agree) where label is the largest cluster's most frequent spelling and
    agree[i] says whether answers[i] is in that cluster. A tie for the
    largest cluster, or no answers at all, gives (None, all False), as the
    paper's public code does.
    """
    return majority_votes([answers], judge, timeout)[0]
