"""Packed micro-batches, rank balancing and the update-efficiency measure (trapo/engine/packing.py)."""

import random

import pytest
import torch

from trapo import console
from trapo.engine.attention import register_attention
from trapo.engine.batch import TrainSequence, collate
from trapo.engine.packing import (
    balance,
    collate_packed,
    micro_batches,
    pack_rows,
    update_efficiency,
    work_counts,
)


def test_pack_rows_first_fit_decreasing_within_the_budget():
    lengths = [5, 9, 3, 7, 2, 12]
    rows = pack_rows(lengths, budget=10)
    # the rule, by hand: 12 alone (over budget); 9 -> bin 2; 7 -> bin 3; 5 -> bin 4; 3 -> bin 3 (7+3); 2 -> bin 4
    assert rows == [[5], [1], [3, 2], [0, 4]]
    assert sorted(i for r in rows for i in r) == list(range(6))
    assert all(sum(lengths[i] for i in r) <= 10 for r in rows if len(r) > 1)


@pytest.mark.parametrize("packed", [True, False])
def test_a_budget_below_one_sequence_is_said_once_with_the_key_the_longest_and_the_fix(monkeypatch, packed):
    said = []
    monkeypatch.setattr(console, "_warned", set())
    monkeypatch.setattr(console, "say", said.append)
    assert micro_batches([5, 9, 3], budget=12, packed=packed)  # every sequence fits: nothing said
    assert said == []
    for _ in range(3):  # every update of the run: one sequence per micro-batch, said the first time only
        assert micro_batches([30, 12, 41], budget=10, packed=packed) == [[2], [0], [1]]
    assert len(said) == 1
    assert said[0].startswith("warning: train.micro_batch_tokens=10 is smaller than one sequence")
    assert "the longest has 41 tokens" in said[0] and "set train.micro_batch_tokens >= 41" in said[0]


def test_collate_packed_restarts_positions_and_never_predicts_across_sequences():
    a = TrainSequence(ids=[1, 2, 3, 4], prompt_len=2, advantage=1.0, weight=1.0, labeled=True)
    b = TrainSequence(ids=[5, 6, 7], prompt_len=1, advantage=-1.0, weight=1.0, labeled=False)
    out = collate_packed([a, b], pad_id=0)
    assert out["packed_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7]]
    assert out["packed_positions"].tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert out["packed_bounds"] == [0, 4, 7]
    # position t predicts t+1: a's 3, 4 (from positions 1, 2); b's 6, 7 (positions 4, 5); 4 -> 5 is masked
    assert out["packed_response"].tolist() == [[False, True, True, False, True, True]]
    padded = collate([a, b], pad_id=0)
    assert torch.equal(out["response_mask"], padded["response_mask"])
    packed_targets = out["packed_ids"][:, 1:][out["packed_response"]]
    assert torch.equal(packed_targets, padded["input_ids"][:, 1:][padded["response_mask"]])  # the same order


def test_balance_evens_tokens_deterministically_and_keeps_every_sequence():
    lengths = [[900, 30, 40, 20, 700], [10, 15]]  # rank 0 has nearly everything
    plan = balance(lengths)
    assert sorted(x for p in plan for x in p) == [(r, i) for r, row in enumerate(lengths) for i in range(len(row))]
    loads = [sum(lengths[r][i] for r, i in p) for p in plan]
    # by hand, longest first onto the lighter rank: 900 -> 0; then 700, 40, 30, 20, 15, 10 all -> 1 (< 900)
    assert loads == [900, 700 + 40 + 30 + 20 + 15 + 10] and balance(lengths) == plan
    assert plan[0] == sorted(plan[0])  # the original order within a rank


def test_work_counts_and_efficiency_by_hand():
    # rank 0: micro-batches [4, 2] and [3]; rank 1: [5]. Padded: rank 0 costs 2*4=8 and 3, rank 1 costs 5
    # slot 1 max 8, slot 2 max 3 (rank 1 runs a filler) -> computed = 2 * 11 = 22; real 14; padded 16
    counts = work_counts([[[4, 2], [3]], [[5]]], signal_tokens=11, packed=False)
    assert counts == {"signal": 11, "real": 14, "padded": 16, "computed": 22}
    eff = update_efficiency(counts)
    assert eff["update_efficiency"] == pytest.approx(11 / 22)
    assert eff["padding_share"] == pytest.approx(2 / 22)
    assert eff["imbalance_share"] == pytest.approx(6 / 22)
    assert eff["zero_signal_share"] == pytest.approx(3 / 22)
    assert sum(eff.values()) == pytest.approx(1.0)
    packed = work_counts([[[4, 2], [3]], [[5]]], signal_tokens=14, packed=True)  # slot maxes 6 and 3
    assert packed == {"signal": 14, "real": 14, "padded": 14, "computed": 18}
    assert update_efficiency(work_counts([[[4, 4]], [[4, 4]]], 16, True))["update_efficiency"] == 1.0


def test_packed_attention_matches_padded_forward_and_gradients():
    """A tiny Qwen2 in fp32: per-token log-probs and every parameter's gradient, packed vs right-padded."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.config.use_cache = False
    rng = random.Random(0)
    seqs = [
        TrainSequence([rng.randrange(1, 64) for _ in range(n)], p, 1.0, 1.0, True)
        for n, p in [(30, 5), (7, 3), (64, 10), (9, 6), (2, 1)]
    ]

    def logprobs(ids, rows, **kw):
        logits = model(input_ids=ids, **kw).logits[:, :-1].log_softmax(-1)
        return logits.gather(-1, ids[:, 1:, None])[..., 0][rows]

    padded = collate(seqs, 0)
    a = logprobs(padded["input_ids"], padded["response_mask"], attention_mask=padded["attention_mask"])
    grad_a = torch.autograd.grad(a.sum(), list(model.parameters()))
    model.set_attn_implementation(register_attention())
    packed = collate_packed(seqs, 0)
    b = logprobs(
        packed["packed_ids"],
        packed["packed_response"],
        position_ids=packed["packed_positions"],
        attention_mask=None,
        packed_bounds=packed["packed_bounds"],
    )
    grad_b = torch.autograd.grad(b.sum(), list(model.parameters()))
    assert a.shape == b.shape == (sum(len(s.ids) - s.prompt_len for s in seqs),)
    assert torch.allclose(a, b, atol=1e-5)
    assert all(torch.allclose(x, y, atol=1e-5, rtol=1e-4) for x, y in zip(grad_a, grad_b))
    # Without the bounds the row would be one long sequence: attention crosses sequences and differs.
    c = logprobs(
        packed["packed_ids"], packed["packed_response"], position_ids=packed["packed_positions"], attention_mask=None
    )
    assert (a - c).abs().max() > 1e-2
