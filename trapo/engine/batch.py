"""Turning graded rollouts into training tensors: sequences, token-budget micro-batches, collation.

Pure functions (no model, no distributed calls); the trainer owns the loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class TrainSequence:
    ids: list[int]  # prompt + response tokens
    prompt_len: int
    advantage: float
    weight: float  # the gate M (1 for labeled questions)
    labeled: bool
    old_logprobs: list[float] | None = None  # per response token; only when several updates share a rollout batch
    engine_logprobs: list[float] | None = None  # per response token, as the rollout engine sampled it
    ref_logprobs: list[float] | None = None  # per response token, the reference model's (loss.beta > 0)
    truncated: bool = False  # the response was cut at rollout.max_tokens (loss.overlong=mask leaves it out)


def build_sequences(
    prompts: list[list[int]],
    responses: list[list[list[int]]],
    advantages: list[list[float]],
    gate: list[float],
    labeled: list[bool],
    engine_logprobs: list[list[list[float] | None]] | None = None,
    truncated: list[list[bool]] | None = None,
) -> list[TrainSequence]:
    """One step's training sequences, question-major: [b * G].

    prompts: [b] prompt token ids; responses: [b][G] response token ids;
    advantages: [b][G] (paper eq. "advantage", `trapo.algorithm.loss.group_advantages`);
    gate: [b] M per question; labeled: [b]; engine_logprobs: [b][G] per-token
    log-probs from the rollout engine, or None; truncated: [b][G] whether each
    response hit rollout.max_tokens, or None (none did).
    """
    if engine_logprobs is None:
        engine_logprobs = [[None] * len(group) for group in responses]
    if truncated is None:
        truncated = [[False] * len(group) for group in responses]
    return [
        TrainSequence(
            ids=prompt + response,
            prompt_len=len(prompt),
            advantage=adv,
            weight=m,
            labeled=is_labeled,
            engine_logprobs=lp,
            truncated=cut,
        )
        for prompt, group, group_adv, m, is_labeled, group_lp, group_cut in zip(
            prompts, responses, advantages, gate, labeled, engine_logprobs, truncated
        )
        for response, adv, lp, cut in zip(group, group_adv, group_lp, group_cut)
    ]


def pack_by_tokens(lengths: list[int], budget: int) -> list[list[int]]:
    """Group sequence indices into micro-batches of at most `budget` padded tokens.

    Longest first, so that sequences of similar length share a micro-batch
    and little padding is computed; a sequence longer than the budget gets a
    micro-batch of its own. Returns index lists covering every sequence once.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i in order:
        w = max(width, lengths[i])
        if current and (len(current) + 1) * w > budget:
            batches.append(current)
            current, w = [], lengths[i]
        current.append(i)
        width = w
    if current:
        batches.append(current)
    return batches


def collate(seqs: list[TrainSequence], pad_id: int) -> dict[str, Tensor]:
    """Right-padded tensors for one micro-batch of b sequences, T = longest.

    input_ids, attention_mask: [b, T]; response_mask: [b, T-1], true where
    position t predicts a response token (t + 1 >= prompt_len);
    advantages, weights: [b]; old_logprobs, engine_logprobs, ref_logprobs: [b, T-1] when
    every sequence has them (0 outside the response).
    """
    b, length = len(seqs), max(len(s.ids) for s in seqs)
    input_ids = torch.full((b, length), pad_id, dtype=torch.long)  # [b, T]
    attention = torch.zeros(b, length, dtype=torch.long)  # [b, T]
    response = torch.zeros(b, length - 1, dtype=torch.bool)  # [b, T-1]
    for row, s in enumerate(seqs):
        input_ids[row, : len(s.ids)] = torch.tensor(s.ids)
        attention[row, : len(s.ids)] = 1
        response[row, s.prompt_len - 1 : len(s.ids) - 1] = True
    out = {
        "input_ids": input_ids,
        "attention_mask": attention,
        "response_mask": response,
        "advantages": torch.tensor([s.advantage for s in seqs], dtype=torch.float32),  # [b]
        "weights": torch.tensor([s.weight for s in seqs], dtype=torch.float32),  # [b]
    }
    for key in ("old_logprobs", "engine_logprobs", "ref_logprobs"):
        if all(getattr(s, key) is not None for s in seqs):
            values = torch.zeros(b, length - 1)  # [b, T-1]
            for row, s in enumerate(seqs):
                values[row, s.prompt_len - 1 : len(s.ids) - 1] = torch.tensor(getattr(s, key))
            out[key] = values
    return out
