"""The reproduction's plan in code, fixed before any method ran (the package docstring states it in
prose): seeds and epochs, evaluation cadence, labeled ratio, the methods and their trainer overrides,
protocols, read-out rules, the claims, and each method's step budget per protocol."""

from __future__ import annotations

from trapo import runtime

ROOT = runtime.ROOT
CONFIG = ROOT / "configs" / "toy_trap.yaml"

SEEDS, EPOCHS = [0, 1, 2, 3, 4, 5, 6, 7], 16
QUICK_SEEDS, QUICK_EPOCHS = [0, 1, 2], 8
EVAL_EVERY = 4  # steps; one epoch of the 256-question methods
LABELED_RATIO = 0.25  # 64 of the 256 training questions
# --tiny (the test suite's runs): the toy's sizes for every path with a few questions
TINY_TOY = dict(labeled=16, unlabeled=48, test=16, validation=16, unlabeled_ood=48, sft_steps=100)
PAPER_FIG4_GAP = 0.40  # Figure 4: top 10% by TCS beat the bottom 10% by over 40 points

# method -> (setting, trainer overrides); setting "id": unlabeled questions are subtractions, "ood": additions
METHODS = {
    "supervised": ("id", ["mode=supervised"]),
    "unsupervised": ("id", ["mode=unsupervised"]),
    "naive_semi": ("id", ["mode=naive_semi"]),
    "trapo": ("id", ["mode=trapo"]),
    "trapo_random": ("id", ["mode=trapo", "selection.strategy=random"]),
    "naive_semi_ood": ("ood", ["mode=naive_semi"]),
    "trapo_ood": ("ood", ["mode=trapo"]),
}
LABELS = {
    "supervised": "Supervised, 64 labeled only",
    "unsupervised": "Unsupervised TTRL, all 256",
    "naive_semi": "Naive semi-supervised",
    "trapo": "TraPO",
    "trapo_random": "TraPO, random selection",
    "naive_semi_ood": "Naive semi-supervised, unlabeled OOD",
    "trapo_ood": "TraPO, unlabeled OOD",
}
PROTOCOLS = ("equal_epochs", "equal_steps")
RULES = ("best_validation", "last")
# (name, method, baseline, test split): "method beats baseline" on that split's accuracy.
CLAIMS = [
    ("trapo_beats_supervised_id", "trapo", "supervised", "test"),
    ("trapo_beats_naive_semi_id", "trapo", "naive_semi", "test"),
    ("trapo_beats_unsupervised_id", "trapo", "unsupervised", "test"),
    ("trapo_beats_random_selection_id", "trapo", "trapo_random", "test"),
    ("trapo_beats_supervised_ood", "trapo", "supervised", "test_ood"),
    ("trapo_beats_naive_semi_ood", "trapo", "naive_semi", "test_ood"),
    ("trapo_beats_unsupervised_ood", "trapo", "unsupervised", "test_ood"),
    ("ood_setting_trapo_beats_supervised_id", "trapo_ood", "supervised", "test"),
    ("ood_setting_trapo_beats_naive_semi_id", "trapo_ood", "naive_semi_ood", "test"),
    ("ood_setting_trapo_beats_supervised_ood", "trapo_ood", "supervised", "test_ood"),
    ("ood_setting_trapo_beats_naive_semi_ood", "trapo_ood", "naive_semi_ood", "test_ood"),
]


def steps_per_epoch(method: str) -> int:
    """Steps of one pass over the method's own training set: 64 questions per step."""
    return 1 if method == "supervised" else 4


def budgets(epochs: int) -> dict[str, dict[str, int]]:
    """protocol -> method -> its step budget."""
    longest = epochs * max(steps_per_epoch(m) for m in METHODS)
    return {
        "equal_epochs": {m: epochs * steps_per_epoch(m) for m in METHODS},
        "equal_steps": {m: longest for m in METHODS},
    }
