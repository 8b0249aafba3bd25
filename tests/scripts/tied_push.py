"""A weight push into vLLM's tied LM head (run by tests/commands/test_real_model.py).

python tests/scripts/tied_push.py MODEL_DIR

SmolLM2's head is its embedding: the policy pushes the embedding alone (named_parameters lists a shared tensor
once) and vLLM's head must follow it. The embedding is changed far from the checkpoint's before the push, so a
head left with the old values decodes differently from transformers on the new ones. Prints JSON: greedy token
ids before the push, after it, transformers' on the pushed weights, and the reload warnings vLLM logged.
"""

import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from trapo import runtime  # noqa: E402

runtime.configure()

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from trapo import console  # noqa: E402
from trapo.data import stop_token_ids  # noqa: E402
from trapo.engine.vllm_rollout import VllmEngine  # noqa: E402

QUESTIONS = ["What is 23 + 45?", "Li buys 4 bags of 8 apples. How many apples?", "What is 6 * 7?"]
TOKENS = 8


class Seen(logging.Handler):
    """The layer-wise reload's warnings that pass the project's filter (console.silence_benign_...)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def cut(ids: list[int], stops: list[int]) -> list[int]:
    """Token ids up to the first stop token (vLLM and transformers differ in whether they keep it)."""
    return next((ids[:i] for i, t in enumerate(ids) if t in stops), list(ids))


def main(model_dir: str) -> None:
    console.silence_benign_library_warnings()
    seen = Seen()
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addHandler(seen)
    tok = AutoTokenizer.from_pretrained(model_dir)
    stops = stop_token_ids(tok)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    prompts = [tok(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True))["input_ids"] for c in chats]
    engine = VllmEngine(model_dir, dtype="float32", max_model_len=256, seed=0, stop_token_ids=stops)

    def greedy() -> list[list[int]]:
        with engine.turn():
            out = engine.generate(prompts, n=1, temperature=0.0, max_tokens=TOKENS)
        return [cut(o[0].token_ids, stops) for o in out]

    before = greedy()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight
        embedding.add_(torch.randn(embedding.shape, generator=torch.Generator().manual_seed(0)) * embedding.std())
    assert model.get_output_embeddings().weight is embedding  # tied: the head moved with it
    engine.push_weights((name, p.detach().clone()) for name, p in model.named_parameters())
    after = greedy()
    hf = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=TOKENS, do_sample=False)
            hf.append(cut(gen[0, len(p) :].tolist(), stops))
    print(json.dumps({"before": before, "after": after, "hf": hf, "warnings": seen.lines}))


if __name__ == "__main__":
    main(sys.argv[1])
    console.exit_now(0)  # as the entry points do: no interpreter teardown after the work is closed
