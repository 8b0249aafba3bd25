"""Trainer scenarios that need to reach inside one process (run by tests/test_trainer_e2e.py).

python tests/scripts/scenario.py crash_at_commit STEP key=value ...
python tests/scripts/scenario.py disk_full STEP FILL_DIR|simulate key=value ...
python tests/scripts/scenario.py packed_vs_padded key=value ...
python tests/scripts/scenario.py partial_push key=value ...
python tests/scripts/scenario.py weight_push key=value ...
python tests/scripts/scenario.py nan_from STEP key=value ...
python tests/scripts/scenario.py skip_push key=value ...
python tests/scripts/scenario.py placement MODEL_DIR
python tests/scripts/scenario.py checkpointing MODEL_DIR
"""

import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from trapo import runtime  # noqa: E402

runtime.configure()

import torch  # noqa: E402

from trapo.algorithm import loss as loss_module  # noqa: E402
from trapo.commands import toy  # noqa: E402
from trapo.config import load_config  # noqa: E402
from trapo.engine import checkpoint as ckpt  # noqa: E402
from trapo.training import trainer as tr  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def trainer(cfg) -> tr.Trainer:
    """A Trainer the way `python -m trapo train` builds one: the toy's assets first (trapo.commands.toy)."""
    toy.prepare(cfg)
    return tr.Trainer(cfg)


def run(cfg) -> dict:
    toy.prepare(cfg)
    return tr.run(cfg)


def main() -> None:
    scenario, args = sys.argv[1], sys.argv[2:]
    if scenario == "crash_at_commit":
        # A real SIGKILL after every rank wrote the checkpoint but before it is committed.
        crash_step = int(args.pop(0))
        real_commit = ckpt.commit

        def commit(root, step, *rest):
            if step == crash_step:
                os.kill(os.getpid(), signal.SIGKILL)
            return real_commit(root, step, *rest)

        ckpt.commit = commit
        run(load_config(os.path.join(ROOT, "configs", "toy.yaml"), args))
    elif scenario == "disk_full":
        disk_full(int(args.pop(0)), args.pop(0), args)
    elif scenario == "packed_vs_padded":
        packed_vs_padded(load_config(os.path.join(ROOT, "configs", "toy.yaml"), args))
    elif scenario == "persistent_vs_gathered":
        packed_vs_padded(load_config(os.path.join(ROOT, "configs", "toy.yaml"), args), switch="param_persistence")
    elif scenario == "weight_push":
        weight_push(load_config(os.path.join(ROOT, "configs", "toy.yaml"), args))
    elif scenario == "nan_from":
        nan_from = int(args.pop(0))
        real_loss = loss_module.policy_loss  # what PolicyLoss calls
        trainer_ref = {}

        def poisoned(*a, **k):
            loss, metrics = real_loss(*a, **k)
            if trainer_ref["t"].state.step + 1 >= nan_from:
                loss = loss * float("nan")
            return loss, metrics

        loss_module.policy_loss = poisoned
        cfg = load_config(os.path.join(ROOT, "configs", "toy.yaml"), args)
        t = trainer(cfg)
        trainer_ref["t"] = t
        before = [p.detach().clone() for _, p in t.policy.full_weights()]
        try:
            t.train()
        except tr.TrainingError as err:
            after = [p for _, p in t.policy.full_weights()]
            print(json.dumps({"error": str(err), "weights_equal_to_start": all(map(torch.equal, before, after))}))
            return
        print(json.dumps({"error": None}))
    elif scenario == "skip_push":
        # A weight push that silently does nothing: from step 2 on the engine samples from the
        # initial weights, which the engine-vs-policy log-prob difference must show.
        from trapo.engine.vllm_rollout import VllmEngine

        def push(self, named_tensors):
            for _ in named_tensors:  # consumed (the gather is collective), never loaded
                pass
            return 0

        VllmEngine.push_weights = push
        run(load_config(os.path.join(ROOT, "configs", "toy.yaml"), args))
    elif scenario == "partial_push":
        # A push whose iterator leaves out one tensor (a name the engine does not know, as a renamed
        # parameter would): the push must fail naming the engine parameter that got nothing.
        from trapo.engine.vllm_rollout import VllmEngine

        real_push = VllmEngine.push_weights

        def push(self, named_tensors):
            return real_push(self, ((n, t) for n, t in named_tensors if not n.endswith("layers.1.mlp.up_proj.weight")))

        VllmEngine.push_weights = push
        try:
            run(load_config(os.path.join(ROOT, "configs", "toy.yaml"), args))
            print(json.dumps({"error": None}))
        except RuntimeError as err:
            print(json.dumps({"error": str(err)}))
    elif scenario == "placement":
        placement(args[0])
    elif scenario == "checkpointing":
        checkpointing(args[0])
    else:
        raise SystemExit(f"unknown scenario {scenario}")


def disk_full(fail_step: int, fill_dir: str, args: list[str]) -> None:
    """The disk fills up during the save of `fail_step`, through the real entry point (trapo_train.main).

    With a directory: once the staging directory exists, a filler file takes all but 64 KB of that
    directory's filesystem (a small tmpfs in the test), so DeepSpeed's own write hits a real ENOSPC.
    With "simulate" (no tmpfs allowed): every torch.save into the staging directory raises ENOSPC.
    """
    import errno

    real_begin, real_save = ckpt.begin, torch.save

    def begin(root, step):
        tmp = real_begin(root, step)
        if step == fail_step and fill_dir != "simulate":
            free = __import__("shutil").disk_usage(fill_dir).free
            with open(os.path.join(fill_dir, "filler"), "wb") as f:
                f.write(b"\0" * max(free - (64 << 10), 0))
        return tmp

    def save(obj, path, *a, **k):
        if fill_dir == "simulate" and f".step-{fail_step}.tmp" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_save(obj, path, *a, **k)

    ckpt.begin, torch.save = begin, save
    import trapo_train

    sys.exit(trapo_train.main(args))


def packed_vs_padded(cfg, switch: str = "packing") -> None:
    """Log-probs, entropies, loss and full gradients of one update batch, packed and padded (`switch`: the
    train key that is off and on, train.packing; or train.param_persistence: every ZeRO-3 parameter kept
    gathered, or gathered and released per module), from two DeepSpeed ZeRO-3 policies built from the same
    weights; prints the largest differences and the share of parameters DeepSpeed keeps persistent."""
    import dataclasses
    import random

    from deepspeed.utils import safe_get_full_grad

    from trapo.algorithm.loss import policy_loss
    from trapo.commands.toy import build_assets
    from trapo.engine import dist
    from trapo.engine.batch import TrainSequence
    from trapo.training.settings import open_policy, planned

    dist.init_distributed()
    model_dir = str(build_assets(cfg.toy, log=lambda m: None) / "model")
    rng = random.Random(0)
    seqs = []
    for _ in range(24):  # lengths from 3 to ~200 tokens: several micro-batches either way
        prompt = [rng.randrange(3, 300) for _k in range(rng.randrange(2, 12))]
        response = [rng.randrange(3, 300) for _k in range(int(rng.lognormvariate(3.0, 0.9)) + 1)]
        seqs.append(
            TrainSequence(
                prompt + response, len(prompt), advantage=rng.choice([-1.0, 0.5, 1.0]), weight=1.0, labeled=True
            )
        )
    results = {}
    persistent = {}
    for packed in (False, True):
        train = dataclasses.replace(cfg.train, packing=packed if switch == "packing" else cfg.train.packing)
        train = dataclasses.replace(train, micro_batch_tokens=256, **({switch: packed} if switch != "packing" else {}))
        run_cfg = dataclasses.replace(cfg, train=train)
        policy = open_policy(planned(run_cfg, model_dir, 1, say=lambda m: None), model_dir, 1, 0)
        params = list(policy.engine.module.parameters())
        persistent[packed] = sum(bool(getattr(p, "ds_persist", False)) for p in params) / len(params)
        logprobs, entropies, losses = [None] * len(seqs), [None] * len(seqs), 0.0
        for group, batch in policy._microbatches(seqs):
            stats = policy._token_stats(batch, entropy=True)
            mask = batch["response_mask"]
            loss, _ = policy_loss(
                stats.logprobs,
                stats.logprobs.detach(),
                batch["advantages"],
                mask,
                weights=batch["weights"],
                entropy=stats.entropy,
                denom=4096.0,
            )
            policy.engine.backward(loss)
            losses += float(loss)
            for row, i in enumerate(group):
                logprobs[i] = stats.logprobs[row][mask[row]].detach()
                entropies[i] = stats.entropy[row][mask[row]].detach()
        grads = {n: safe_get_full_grad(p).clone() for n, p in policy.engine.module.named_parameters()}
        results[packed] = (torch.cat(logprobs), torch.cat(entropies), losses, grads, len(policy._groups(seqs)))
    (lp0, h0, l0, g0, mb0), (lp1, h1, l1, g1, mb1) = results[False], results[True]
    print(
        json.dumps(
            {
                "tokens": lp0.numel(),
                "microbatches": [mb0, mb1],
                "logprob": float((lp0 - lp1).abs().max()),
                "entropy": float((h0 - h1).abs().max()),
                "loss": abs(l0 - l1),
                "loss_value": l0,
                "grad": max(float((g0[n] - g1[n]).abs().max()) for n in g0),
                "grad_scale": max(float(g0[n].abs().max()) for n in g0),
                "persistent_share": [persistent[False], persistent[True]],
            }
        )
    )


def placement(model_dir) -> None:
    """The engine reports where it sits, and the check fails loudly when that is not the rank's device."""
    import random

    import numpy as np

    from trapo.engine.rollout_engine import RolloutEngine
    from trapo.engine.vllm_rollout import VllmEngine

    random.seed(12345), np.random.seed(12345), torch.manual_seed(12345)  # the trainer's streams
    before = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(12345), np.random.seed(12345), torch.manual_seed(12345)
    engine = VllmEngine(model_dir, dtype="float32", max_model_len=64, seed=0, cpu_kv_cache_gb=0.05, max_num_seqs=24)
    after = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    result = {
        "device": engine.device(),
        "config": engine.effective_config(),
        "rng_kept": [a == b for a, b in zip(before, after)],
        "max_num_seqs": engine.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs,
        "interface": isinstance(engine, RolloutEngine),
    }
    engine.on_gpu = True  # as if on a GPU machine: the engine should then sit on cuda:LOCAL_RANK
    try:
        engine.check_placement()
        result["error"] = None
    except RuntimeError as err:
        result["error"] = str(err)
    print(json.dumps(result))


def checkpointing(model_dir) -> None:
    """For each model.gradient_checkpointing: whether the built policy's model recomputes its layers, and the line
    `planned` said."""
    import dataclasses

    from trapo.engine import dist
    from trapo.training.settings import open_policy, planned

    dist.init_distributed()
    cfg = load_config(os.path.join(ROOT, "configs", "toy.yaml"), [])
    result = {}
    for value in (True, False, "auto"):
        said = []
        run_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, gradient_checkpointing=value))
        policy = open_policy(planned(run_cfg, model_dir, 1, say=said.append), model_dir, 1, 0)
        result[str(value)] = {"on": policy.model.is_gradient_checkpointing, "said": said}
    print(json.dumps(result))


def weight_push(cfg) -> None:
    """After two updates, vLLM's greedy output must equal transformers' on the gathered weights."""
    from transformers import AutoModelForCausalLM

    t = trainer(cfg)
    start = {n: p for n, p in t.policy.full_weights()}
    t.train_step()
    t.train_step()
    weights = dict(t.policy.full_weights())
    changed = sum(not torch.equal(start[n], w) for n, w in weights.items())
    from trapo.data import tokenize_prompts

    questions = [q for b in t.evaluator.test_benchmarks for q in b.questions]
    prompts = tokenize_prompts(questions, cfg.data.prompt_template, t.tokenizer, cfg.data.max_prompt_tokens)
    vllm_out = [o[0].token_ids for o in t.rollouts.engine.generate(prompts, n=1, temperature=0.0, max_tokens=8)]
    del t.policy._hf_ds  # transformers would otherwise build this reference model partitioned under ZeRO-3
    model = AutoModelForCausalLM.from_pretrained(t.model_dir, dtype=torch.float32)
    model.load_state_dict(weights)
    model.eval()
    hf_out = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=t.tokenizer.eos_token_id,
            pad_token_id=t.tokenizer.pad_token_id,
        )
        hf_out.append(gen[0, len(p) :].tolist())
    print(
        json.dumps(
            {
                "changed": changed,
                "total": len(weights),
                "match": vllm_out == hf_out,
                "vllm": vllm_out[:3],
                "hf": hf_out[:3],
            }
        )
    )
    t.close()


if __name__ == "__main__":
    main()
    from trapo import console

    console.exit_now(0)  # as the entry points do: no interpreter teardown after the work is closed
