"""Micro-batching, collation and the gate's effect on gradients."""

import torch

from trapo.algorithm.logits import token_logprobs
from trapo.algorithm.loss import loss_denominator, policy_loss
from trapo.engine.batch import TrainSequence, collate, pack_by_tokens


def test_pack_by_tokens_respects_budget_and_covers_all():
    lengths = [5, 9, 3, 9, 4, 20]
    groups = pack_by_tokens(lengths, budget=20)
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert groups[0] == [5]  # 20 tokens alone
    for g in groups:
        assert len(g) * max(lengths[i] for i in g) <= 20 or len(g) == 1
    assert pack_by_tokens([30], 10) == [[0]]


def test_collate_marks_response_positions():
    s = [TrainSequence([1, 2, 3, 4, 5], 3, 0.5, 1.0, True), TrainSequence([1, 2, 9], 2, -1.0, 0.0, False)]
    b = collate(s, pad_id=0)
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 5], [1, 2, 9, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    # position t predicts token t+1: responses are tokens 3..4 (seq 0) and 2 (seq 1)
    assert b["response_mask"].tolist() == [[False, False, True, True], [False, True, False, False]]
    assert b["advantages"].tolist() == [0.5, -1.0] and b["weights"].tolist() == [1.0, 0.0]
    s[0].old_logprobs, s[1].old_logprobs = [-1.0, -2.0], [-3.0]
    assert collate(s, 0)["old_logprobs"].tolist() == [[0, 0, -1, -2], [0, -3, 0, 0]]


def test_denominators():
    assert loss_denominator("dr_grpo", 16, 100, 12) == 192
    assert loss_denominator("token_mean", 16, 100, 12) == 100
    assert loss_denominator("seq_mean", 16, 100, 12) == 16


def _grads(model, seqs, denom):
    """(the parameters' gradient, flattened; the gradient of the logits, [b, T, V])."""
    model.zero_grad()
    b = collate(seqs, 0)
    logits = model(b["input_ids"])  # [b, T, V]
    logits.retain_grad()
    lp = token_logprobs(logits[:, :-1], b["input_ids"][:, 1:])
    loss, _ = policy_loss(
        lp, lp.detach(), b["advantages"], b["response_mask"], weights=b["weights"], denom=denom, entropy=None
    )
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()]), logits.grad


def test_gate_zero_removes_unlabeled_gradient_exactly():
    """L = J_l + M * J_u: with M = 0 the gated sequence sends exactly zero gradient into the model, and the
    parameters' gradient is the labeled-only one (same denominator). That last comparison is to float
    rounding, not bitwise: the weight gradient is one matrix product over every row, and a product with
    one more (zero) row may sum in another order (it does on some x86 CPUs' kernels)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11))
    labeled = [TrainSequence([1, 2, 3, 4], 2, 1.0, 1.0, True), TrainSequence([1, 5, 6], 2, -1.0, 1.0, True)]
    unlabeled = [TrainSequence([7, 8, 9, 10], 1, 2.0, 0.0, False)]
    with_gated, logit_grads = _grads(model, labeled + unlabeled, denom=50.0)
    labeled_only, _ = _grads(model, labeled, denom=50.0)
    assert torch.count_nonzero(logit_grads[2]) == 0  # the gated row: nothing flows back from it
    assert torch.allclose(with_gated, labeled_only, rtol=1e-6, atol=1e-9)
    unlabeled[0].weight = 1.0
    assert not torch.allclose(_grads(model, labeled + unlabeled, denom=50.0)[0], labeled_only, rtol=1e-3)
