"""bench/peers/run.py's rule for what may be compared: both sides at the forced length, and both updating."""

import importlib.util
import os

from toyrun import ROOT

_spec = importlib.util.spec_from_file_location("peers_run", os.path.join(ROOT, "bench", "peers", "run.py"))
peers_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peers_run)


def test_a_side_that_skipped_an_update_or_missed_the_forced_length_is_not_compared():
    ours = {"mean_length": [256.0] * 3, "skipped": [False] * 3}
    assert peers_run.not_comparable("ours-hf", 256, ours) is None
    trl = {"mean_length": [256.0] * 3}  # TRL always updates: it reports no skips
    assert peers_run.not_comparable("trl", 256, trl) is None
    # the first step is each process's warm-up, left out of the figures and of the rule
    assert peers_run.not_comparable("ours-hf", 256, {**ours, "skipped": [True, False, False]}) is None
    skipped = peers_run.not_comparable("ours-hf", 256, {**ours, "skipped": [False, True, False]})
    assert skipped == "ours-hf at 256 tokens skipped an update (every reward equal): not comparable"
    short = peers_run.not_comparable("trl", 256, {"mean_length": [256.0, 255.5, 256.0]})
    assert short == "trl generated [255.5, 256.0] tokens on average, not the forced 256"
