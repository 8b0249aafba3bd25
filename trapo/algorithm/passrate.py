"""Pass-rate trajectories, trajectory cosine similarity (TCS) and selection.

Paper section "Progressive Trajectory Guidance" and the pseudo code:

- P_q^(t): fraction of a question's G rollouts that match its gold answer
  (labeled) or its majority-vote pseudo-label (unlabeled)   eq. "pass_rate"
- T_q^(t) = [P_q^(1), ..., P_q^(t)]                         eq. "trajectory"
- D_reliable starts as all labeled trajectories, grows with the unlabeled
  ones selected after warm-up; its mean is the reference     eq. "db_init", "avg_trajectory"
- TCS = cosine of a trajectory and the reference             eq. "cos_similarity"
- M(u) = u in top-p(TCS) OR TCS >= Gamma                    eq. "reliable_mask"

The other selection strategies (random, sentence entropy, self-certainty;
section "Different Selection Strategies") and a fixed selection ratio are in
`trapo.algorithm.selection`; the tracker records the confidence scores they rank by.

The functions are pure and vectorised (no Python loop over questions).
`PassRateTracker` owns the per-question state across epochs.

Timing. The paper's pseudo code treats an epoch as one step: roll out every
question, then select, then update. A step-wise trainer cannot know a
question's epoch-t pass rate before its batch comes up, so the tracker
selects at epoch boundaries: the gate used during epoch t+1 comes from the
trajectories through epoch t (all of equal length t). With
`warmup_epochs = W`, epochs 1..W train on labeled data only and the first
selection uses trajectories of length W.
"""

from __future__ import annotations

import math
from dataclasses import asdict

import torch
import torch.nn.functional as F
from torch import Tensor

from trapo.algorithm.selection import confidence_kind, random_seed_for, select
from trapo.config import REFERENCES, SelectionConfig  # noqa: F401  (SelectionConfig: the tracker's config type)


def pass_rates(correct: Tensor) -> Tensor:
    """Eq. "pass_rate": correct [B, G] (bool or 0/1) -> [B] fraction correct."""
    return correct.float().mean(dim=1)


def tcs(trajectories: Tensor, reference: Tensor) -> Tensor:
    """Trajectory cosine similarity, eq. "cos_similarity".

    trajectories: [N, t], reference: [t] -> [N]. Both sides are L2-normalised
    over their t entries and dotted. A zero trajectory (never solved) or a
    zero reference scores 0, never NaN.
    """
    if trajectories.dim() != 2 or reference.dim() != 1 or trajectories.shape[1] != reference.shape[0]:
        raise ValueError(
            f"tcs: expected trajectories [N, t] and reference [t], got {tuple(trajectories.shape)} "
            f"and {tuple(reference.shape)}"
        )
    unit = F.normalize(trajectories.float(), dim=1)  # [N, t]; zero rows stay zero
    ref = F.normalize(reference.float(), dim=0)  # [t]
    return unit @ ref  # [N]


def zscore(trajectories: Tensor) -> Tensor:
    """Standardise each row: (T - mean(T)) / std(T); a constant row becomes zeros.

    trajectories: [N, t] -> [N, t]. This is the normalisation the paper's
    public code applies before its cosine; it turns the cosine into a Pearson
    correlation (trend only, level ignored).
    """
    x = trajectories.float()
    centered = x - x.mean(dim=1, keepdim=True)  # [N, t]
    std = x.std(dim=1, unbiased=False, keepdim=True)  # [N, 1]
    return torch.where(std > 0, centered / std.clamp_min(1e-12), torch.zeros_like(centered))


def similarity_scores(
    trajectories: Tensor,
    database: Tensor,
    *,
    reference: str = "mean_trajectory",
    standardize: bool = False,
    chunk_elems: int = 1 << 24,
) -> Tensor:
    """Score trajectories [N, t] against a reliable database [M, t] -> [N].

    reference:
      "mean_trajectory" (paper, default): TCS to the database's mean trajectory.
      "mean_cosine" (paper's public code): mean over database rows of the
          cosine to each row. Computed as unit(T_i) . mean_j unit(D_j), which
          equals the mean of the M cosines without forming an [N, M] matrix.
      "max_cosine" (paper's Table "MeanorMax", "TraPO-Max"): the largest
          cosine to any database row; [N, M] in chunks of chunk_elems.
    standardize: z-score every row of both sides first (public code).
    An empty database scores every trajectory 0.
    """
    if reference not in REFERENCES:
        raise ValueError(f"similarity_scores: reference must be one of {REFERENCES}, got {reference!r}")
    n, t = trajectories.shape
    if database.dim() != 2 or database.shape[1] != t:
        raise ValueError(f"similarity_scores: database must be [M, {t}], got {tuple(database.shape)}")
    if n == 0 or database.shape[0] == 0 or t == 0:
        return torch.zeros(n)
    x = zscore(trajectories) if standardize else trajectories.float()  # [N, t]
    db = zscore(database) if standardize else database.float()  # [M, t]
    if reference == "mean_trajectory":
        return tcs(x, db.mean(dim=0))
    x_unit = F.normalize(x, dim=1)  # [N, t]
    db_unit = F.normalize(db, dim=1)  # [M, t]
    if reference == "mean_cosine":
        return x_unit @ db_unit.mean(dim=0)  # [N]
    rows = max(1, chunk_elems // db_unit.shape[0])
    return torch.cat([(x_unit[i : i + rows] @ db_unit.T).amax(dim=1) for i in range(0, n, rows)])


def reliable_mask(scores: Tensor, top_p: float, threshold: float) -> Tensor:
    """Eq. "reliable_mask": top-p by score OR score >= threshold.

    scores: [N] -> BoolTensor [N]. The top k = max(1, floor(top_p * N)) scores
    are kept; equal scores at the cut are broken by lower index (a stable
    sort), so the result is deterministic. N = 0 gives an empty mask.
    """
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"reliable_mask: top_p must be in [0, 1], got {top_p}")
    n = scores.numel()
    mask = torch.zeros(n, dtype=torch.bool, device=scores.device)
    if n == 0:
        return mask
    k = max(1, math.floor(top_p * n + 1e-9))  # the epsilon keeps 0.29 * 100 at 29, not 28
    order = torch.argsort(scores, descending=True, stable=True)  # [N]
    mask[order[:k]] = True
    return mask | (scores >= threshold)


def _extended(history: Tensor, current: Tensor, first: float) -> Tensor:
    """history [Q, t] with the epoch's column appended: `current` [Q] where recorded, NaN where not, which
    keeps the previous epoch's value (`first` in the first epoch) -> [Q, t + 1]."""
    previous = history[:, -1] if history.shape[1] else torch.full_like(current, first)
    return torch.cat([history, torch.where(torch.isnan(current), previous, current)[:, None]], dim=1)


def _mean_or_none(values: Tensor) -> float | None:
    return float(values.float().mean()) if values.numel() else None


class PassRateTracker:
    """Per-question pass-rate trajectories, the reliable database and the gate.

    Questions are indexed 0..Q-1; `labeled` [Q] says which carry a gold answer.
    Per batch the trainer calls `record(indices, pass_rates, pseudo_correct,
    confidence)` (confidence: only for the strategies that rank by it);
    per epoch `end_epoch()`, which appends the epoch's column to every
    trajectory and recomputes the selection; `gate(indices)` then gives the
    loss weight M for each question (1 for labeled ones).

    A question not recorded in an epoch (a dropped last batch, or one the
    curriculum skipped) keeps its previous pass rate for that epoch (0 in the
    first), so every trajectory has one entry per epoch; `observed` [Q, t]
    marks the recorded entries (False: carried), and `end_epoch` reports how
    many were filled so. Confidence scores carry over the same way (NaN before
    the first).
    """

    def __init__(self, labeled: Tensor, config: SelectionConfig | None = None):
        if labeled.dim() != 1:
            raise ValueError(f"PassRateTracker: labeled must be [Q], got {tuple(labeled.shape)}")
        self.config = config or SelectionConfig()
        self.labeled = labeled.bool().clone()  # [Q]
        q = self.num_questions
        self.trajectories = torch.zeros(q, 0)  # [Q, t]
        self.observed = torch.zeros(q, 0, dtype=torch.bool)  # [Q, t]; False: the entry was carried forward
        self.bought = torch.zeros(q, dtype=torch.bool)  # [Q]; unlabeled questions whose gold was bought (labels.*)
        self.in_database = self.labeled.clone()  # [Q]; eq. "db_init"
        self.selected = torch.zeros(q, dtype=torch.bool)  # [Q]; gate for the current epoch
        self.scores = torch.zeros(q)  # [Q]; latest TCS (0 for labeled)
        self.ranking = torch.full((q,), float("nan"))  # [Q]; latest strategy score (NaN: labeled or none)
        self.confidence = torch.full((q, 0), float("nan"))  # [Q, t]; per-epoch mean confidence, NaN unscored
        self._current_confidence = torch.full((q,), float("nan"))  # [Q]; this epoch's, NaN = not yet seen
        self._current = torch.full((q,), float("nan"))  # [Q]; this epoch's P_q, NaN = not yet seen
        self._correct = torch.full((q,), float("nan"))  # [Q]; pseudo-label == hidden gold, NaN unknown
        self.last_correct = self._correct.clone()  # [Q]; the last closed epoch's

    @property
    def num_questions(self) -> int:
        return self.labeled.shape[0]

    @property
    def epoch(self) -> int:
        """Number of completed epochs (the trajectories' length t)."""
        return self.trajectories.shape[1]

    def record(
        self, indices: Tensor, rates: Tensor, pseudo_correct: Tensor | None = None, confidence: Tensor | None = None
    ) -> None:
        """Store this epoch's pass rates for some questions.

        indices: [B] int, rates: [B] in [0, 1]; pseudo_correct: [B] bool, or
        float with NaN for unknown, saying whether an unlabeled question's
        majority-vote label equals its hidden gold (diagnostics only);
        confidence: [B] float, the mean confidence score of each question's G
        responses (NaN: not scored, e.g. labeled), for the "entropy" and
        "self_certainty" strategies.
        """
        indices = indices.long().cpu()
        rates = rates.float().cpu()
        if indices.shape != rates.shape or indices.dim() != 1:
            raise ValueError(
                f"record: indices and rates must both be [B], got {tuple(indices.shape)}, {tuple(rates.shape)}"
            )
        if indices.numel() and (indices.min() < 0 or indices.max() >= self.num_questions):
            raise IndexError(f"record: question index out of range [0, {self.num_questions})")
        if rates.numel() and not bool(((rates >= 0) & (rates <= 1)).all()):
            raise ValueError("record: pass rates must lie in [0, 1]")
        self._current[indices] = rates
        if pseudo_correct is not None:
            self._correct[indices] = pseudo_correct.float().cpu()
        if confidence is not None:
            confidence = confidence.float().cpu()
            if confidence.shape != indices.shape:
                raise ValueError(f"record: confidence must be [B] like indices, got {tuple(confidence.shape)}")
            self._current_confidence[indices] = confidence

    def gate(self, indices: Tensor) -> Tensor:
        """Loss weight M per question: 1 for labeled (or bought), the selection for unlabeled. [B] -> [B] float."""
        idx = indices.long().cpu()
        return (self.labeled[idx] | self.bought[idx] | self.selected[idx]).float()

    def add_labels(self, indices: Tensor) -> None:
        """Unlabeled questions whose gold was bought: labeled from now on (gate 1, no longer selection
        candidates). Their trajectories, pseudo pass rates so far, stay out of the reliable database."""
        idx = indices.long().cpu()
        if bool((self.labeled[idx] | self.bought[idx]).any()):
            raise ValueError("add_labels: a question is labeled already, or was bought before")
        self.bought[idx] = True
        self.selected[idx] = False

    def mean_reference(self) -> Tensor:
        """The reliable database's mean trajectory [t] (eq. "avg_trajectory")."""
        return self.trajectories[self.in_database].mean(dim=0) if self.in_database.any() else torch.zeros(self.epoch)

    def end_epoch(self) -> dict:
        """Close the epoch: extend trajectories, select, grow the database.

        Returns diagnostics: epoch, strategy, unrecorded (filled) count,
        selected count, database size, mean TCS and mean strategy score
        (`score_*`: TCS, the confidence, None for random) of selected vs
        rejected unlabeled questions, unscored (unlabeled questions without a
        confidence score, for the strategies that need one), and pseudo-label
        precision of selected vs rejected among those with a hidden gold (the
        paper's Figure 4 analysis).
        """
        unseen = torch.isnan(self._current)
        self.trajectories = _extended(self.trajectories, self._current, first=0.0)  # [Q, t]
        self.observed = torch.cat([self.observed, ~unseen[:, None]], dim=1)  # [Q, t]
        self.confidence = _extended(self.confidence, self._current_confidence, first=float("nan"))  # [Q, t]
        conf = self.confidence[:, -1]  # [Q]
        self._current_confidence = torch.full_like(conf, float("nan"))
        correct = self._correct
        self.last_correct = correct  # [Q]: this epoch's pseudo-label == hidden gold (NaN unknown)
        self._current = torch.full_like(self._current, float("nan"))
        self._correct = torch.full_like(self._correct, float("nan"))

        cfg = self.config
        unlabeled = ~self.labeled & ~self.bought
        self.selected = torch.zeros_like(self.selected)
        self.scores = torch.zeros_like(self.scores)
        self.ranking = torch.full_like(self.ranking, float("nan"))
        ran = self.epoch >= max(cfg.warmup_epochs, 1) and bool(unlabeled.any()) and bool(self.in_database.any())
        if ran:
            u_idx = unlabeled.nonzero().squeeze(1)  # [U]
            scores = similarity_scores(
                self.trajectories[u_idx],
                self.trajectories[self.in_database],
                reference=cfg.reference,
                standardize=cfg.standardize,
            )  # [U]
            rule = reliable_mask(scores, cfg.top_p, cfg.threshold)  # [U]
            chosen, ranking = select(
                cfg.strategy,
                scores,
                conf[u_idx],
                rule,
                fixed_ratio=cfg.fixed_ratio,
                seed=random_seed_for(cfg.random_seed, self.epoch),
            )  # [U], [U]
            self.scores[u_idx] = scores
            self.ranking[u_idx] = ranking
            self.selected[u_idx[chosen]] = True
            self.in_database |= self.selected

        sel = self.selected
        rej = unlabeled & ~sel
        known = ~torch.isnan(correct)
        ranked = ~torch.isnan(self.ranking)
        needs_confidence = confidence_kind(cfg.strategy) is not None
        return {
            "epoch": self.epoch,
            "strategy": cfg.strategy,
            "unrecorded": int(unseen.sum()),
            "selected": int(sel.sum()),
            "unlabeled": int(unlabeled.sum()),
            "database": int(self.in_database.sum()),
            "tcs_selected": _mean_or_none(self.scores[sel]) if ran else None,
            "tcs_rejected": _mean_or_none(self.scores[rej]) if ran else None,
            "score_selected": _mean_or_none(self.ranking[sel & ranked]) if ran else None,
            "score_rejected": _mean_or_none(self.ranking[rej & ranked]) if ran else None,
            "unscored": int((unlabeled & torch.isnan(conf)).sum()) if needs_confidence else None,
            "precision_selected": _mean_or_none(correct[sel & known]),
            "precision_rejected": _mean_or_none(correct[rej & known]),
        }

    def selection_row(self, history: bool = False) -> dict:
        """The last epoch end's per-question view of the unlabeled questions (a selection.jsonl row).

        epoch; strategy; question: [U] indices; tcs: [U] TCS; score: [U] the
        strategy's ranking score (TCS, the mean confidence; None for random or
        an unscored question); pseudo_correct: [U] the
        pseudo-label matched the hidden gold (None unknown); selected: [U] gate;
        pass_rate: [U] this epoch's pass rates; bought: [U] its gold was bought (labels.*; only once any
        was); reference: [t] the reliable
        database's mean trajectory (after this epoch's selection grew it);
        with `history` (a run's first row, so that warm-up epochs are covered)
        pass_rate_history: [U][t] whole trajectories. Pass rates are multiples
        of 1/G, so 4 decimals lose nothing.
        """
        idx = (~self.labeled).nonzero().squeeze(1)  # [U]
        traj = self.trajectories[idx]  # [U, t]
        row = {
            "epoch": self.epoch,
            "question": idx.tolist(),
            "strategy": self.config.strategy,
            "tcs": [round(x, 5) for x in self.scores[idx].tolist()],
            "score": [None if math.isnan(x) else round(x, 5) for x in self.ranking[idx].tolist()],
            "pseudo_correct": [None if math.isnan(c) else bool(c) for c in self.last_correct[idx].tolist()],
            "selected": self.selected[idx].tolist(),
            "pass_rate": [round(x, 4) for x in traj[:, -1].tolist()],
            "reference": [round(x, 4) for x in self.mean_reference().tolist()],
        }
        if self.bought.any():  # labels.*: bought questions are labeled now (gate 1), whatever `selected` says
            row["bought"] = self.bought[idx].tolist()
        if history:
            row["pass_rate_history"] = [[round(x, 4) for x in r] for r in traj.tolist()]
        return row

    def state_dict(self) -> dict:
        return {
            "config": asdict(self.config),
            "labeled": self.labeled.clone(),
            "bought": self.bought.clone(),
            "trajectories": self.trajectories.clone(),
            "observed": self.observed.clone(),
            "in_database": self.in_database.clone(),
            "selected": self.selected.clone(),
            "scores": self.scores.clone(),
            "current": self._current.clone(),
            "correct": self._correct.clone(),
            "ranking": self.ranking.clone(),
            "confidence": self.confidence.clone(),
            "current_confidence": self._current_confidence.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore exactly; the dataset must be the same (same Q, same labeled set)."""
        labeled = state["labeled"].bool()
        if labeled.shape != self.labeled.shape or not torch.equal(labeled, self.labeled):
            raise ValueError(
                "PassRateTracker.load_state_dict: the checkpoint's labeled set "
                f"({int(labeled.sum())} of {labeled.numel()} questions) differs from this run's "
                f"({int(self.labeled.sum())} of {self.num_questions}); resume with the same data"
            )
        self.trajectories = state["trajectories"].float().clone()
        # a checkpoint from before the mask existed: every entry counts as recorded (it carried only dropped ones)
        observed = state.get("observed")
        self.observed = (
            torch.ones_like(self.trajectories, dtype=torch.bool) if observed is None else observed.bool().clone()
        )
        bought = state.get("bought")  # a checkpoint from before labels.*: nothing bought
        self.bought = torch.zeros_like(self.labeled) if bought is None else bought.bool().clone()
        self.in_database = state["in_database"].bool().clone()
        self.selected = state["selected"].bool().clone()
        self.scores = state["scores"].float().clone()
        self._current = state["current"].float().clone()
        self._correct = state["correct"].float().clone()
        self.ranking = state["ranking"].float().clone()
        self.confidence = state["confidence"].float().clone()
        self._current_confidence = state["current_confidence"].float().clone()
