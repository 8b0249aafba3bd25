"""hf generation under ZeRO-3 on two ranks (gloo): the trainer's validation with a benchmark of one question,
so rank 1's shard is empty and it runs no generation forward while rank 0 runs several. Both ranks finish,
and the training steps after it give the losses of a run without the validation, with DeepSpeed's hooks
back as they were and its trace of the module order recorded again.

This file is also the worker: `python test_zero3_generation.py with|without` as one rank (RANK etc. set)."""

import json
import os
import sys

import pytest

from trapo import runtime

DIST_TIMEOUT_MINUTES = 1.0  # a rank left waiting in a collective stops with torch's timeout error


def worker(with_eval: bool) -> dict:
    runtime.configure()
    import torch

    from trapo.commands.toy import _model, _tokenizer
    from trapo.config import Config
    from trapo.data import Benchmark, Question
    from trapo.engine import dist
    from trapo.engine.hf_rollout import HfEngine
    from trapo.training.evaluation import Evaluator

    rank, world, _ = dist.init_distributed(timeout_minutes=DIST_TIMEOUT_MINUTES)
    deepspeed = dist.import_deepspeed()
    tokenizer = _tokenizer([f"{a}+{b}={a + b}" for a in range(30) for b in range(30)])
    model = _model(tokenizer, seed=3)
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},  # every weight partitioned
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
    hf = HfEngine(engine.module, tokenizer, stop_token_ids=[tokenizer.eos_token_id], max_batch=8, zero3_engine=engine)
    cfg = Config()
    cfg.data.prompt_template, cfg.data.max_prompt_tokens = "plain", 32
    cfg.eval.n, cfg.eval.temperature, cfg.eval.max_tokens = 2, 1.0, 6
    one = Question(uid="q0", question="1+2=", answer="3", labeled=True, messages=None, where="test")
    benchmarks = dict(test=[], validation=[Benchmark("one", [one], "test")])
    evaluator = Evaluator(cfg, hf, None, tokenizer, None, rank=rank, world=world, turn=hf.turn, **benchmarks)
    texts = [["1+2=3", "4+5=9", "6+6=12", "2+9=11"], ["12+13=25", "7+8=15", "3+3=6", "20+1=21"]][rank]

    def train(text: str) -> float:
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss.item()

    def trace() -> str:
        return next(s for s in ("invalid", "record", "complete") if getattr(coordinator, f"is_{s}_trace")())

    def validation() -> dict | None:
        traces.append(trace())
        before = hooks()
        scores = evaluator.validation() if with_eval else None
        assert hooks() == before, (before, hooks())  # DeepSpeed's hooks are back, none twice
        return scores

    hooks = lambda: (len(engine.module._forward_pre_hooks), len(engine.module._forward_hooks))  # noqa: E731
    traces = []
    scores = [validation()]  # at step 0 (the trainer's held-out scores): no trace recorded yet
    losses = [train(texts[0])]  # one forward and backward: DeepSpeed is recording the module order
    scores.append(validation())
    losses += [train(text) for text in texts[1:]]
    return {"losses": losses, "scores": scores, "traces": traces, "trace_after": trace()}


def launch(mode: str) -> list[dict]:
    """Both ranks' results (each forked from the worker's fork server, as a toy run's ranks: tests/toyrun.py); a
    rank that fails (the other is then stopped) or waits past the timeout fails the test with its stderr."""
    from toyrun import Ranks

    ranks = Ranks([mode], nproc=2, script=os.path.abspath(__file__))
    done = ranks.wait(timeout=240)
    assert done.returncode == 0, f"{mode} evaluation:\n{done.stderr[-3000:]}"
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in ranks.outputs]


@pytest.mark.toy_run
def test_validation_with_an_empty_shard_finishes_and_training_after_it_is_unchanged():
    evaluated, plain = launch("with"), launch("without")
    assert evaluated[0]["traces"] == ["invalid", "record"]  # when DeepSpeed's start of forward is collective
    assert evaluated[0]["scores"] == evaluated[1]["scores"] and None not in evaluated[0]["scores"]
    for rank in (0, 1):
        assert evaluated[rank]["losses"] == pytest.approx(plain[rank]["losses"], rel=1e-6, abs=0)
        assert evaluated[rank]["trace_after"] == plain[rank]["trace_after"] == "complete"  # recorded again


if __name__ == "__main__":
    print(json.dumps(worker(sys.argv[1] == "with")))
