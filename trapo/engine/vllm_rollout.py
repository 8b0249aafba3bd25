"""The colocated vLLM engine (`rollout.backend: vllm`): one `vllm.LLM` in the trainer process per rank.

Rollouts go in as token ids (no re-tokenisation) and come out as token ids;
vLLM does not detokenize (`detokenize=False`: its per-token detokenizer is a
measurable share of a generate, docs/upstream-notes.md, and only grading
reads the text), and the
text is decoded once per call (`decode_responses`). We pass stop token ids,
never stop strings, so nothing needs vLLM's incremental text.

After each update the trainer streams the policy's weights into the engine
with `push_weights`: vLLM's in-place `reload_weights` consumes an iterator,
so a generator that gathers one ZeRO-3 module at a time keeps peak extra
memory at one layer. On GPU the engine sleeps while the policy trains.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
from collections.abc import Iterable
from typing import TYPE_CHECKING

from trapo import faults
from trapo.engine.rollout import Rollout, decode_responses

if TYPE_CHECKING:
    import torch


def remove_stale_cpu_shm(root: str = "/dev/shm") -> list[str]:
    """Remove the shared-memory segments of tensor-parallel CPU engines that no live process maps.

    vLLM 0.32's CPU communicator (distributed/device_communicators/cpu_communicator.py) names each rank's
    segment from the group alone (`-tp:0-[0-1]-cpushm_<rank>` under external_launcher), and creating one that
    exists fails (EEXIST). A run that ends by os._exit or a kill never unlinks its segments, so without this
    the next tensor-parallel run on the machine could not start. A segment still mapped by a live process (a
    concurrent run) is left alone."""
    import glob

    segments = glob.glob(os.path.join(root, "*cpushm_*"))
    if not segments:
        return []
    mapped = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                mapped.update(line.split(maxsplit=5)[-1].strip() for line in f if "cpushm_" in line)
        except OSError:  # a process that ended meanwhile, or one we may not read
            continue
    removed = []
    for path in segments:
        if path not in mapped:
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed.append(path)
    return removed


def unpushed(names: list[str], packed: dict[str, list[str]], pushed: set[str]) -> list[str]:
    """The engine parameters none of whose checkpoint tensors were pushed (pure).

    names: the engine's parameter names; packed: vLLM's packed_modules_mapping, e.g.
    "model.layers.0.self_attn.qkv_proj.weight" is filled from the q_proj, k_proj and v_proj tensors.
    """
    missing = []
    for name in names:
        module, _, leaf = name.rpartition(".")
        owner, _, short = module.rpartition(".")
        parts = packed.get(short, [short])
        needed = [".".join(p for p in (owner, part, leaf) if p) for part in parts]
        if not all(n in pushed for n in needed):
            missing.append(name)
    return missing


def repack_shared_weights(model) -> int:
    """Pack again the CPU copies of every weight that layers share; returns how many layers (run on vLLM's
    worker, through `apply_model`, after each push).

    vLLM's CPU backend multiplies by a packed copy of a linear layer's weight, made when the layer is loaded
    (model_executor/layers/utils.py, dispatch_cpu_unquantized_gemm, kept in `layer.cpu_linear`). A tied LM
    head (SmolLM2's) is never loaded: its tensor is the embedding's, which a push reloads in place, so the
    head's packed copy keeps the start-up weights and every later token is scored by the old head. On a GPU
    the head multiplies by the shared tensor itself, and nothing is packed."""
    owners: dict[int, list] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if weight is not None:
            owners.setdefault(id(weight), []).append(module)
    shared = [m for modules in owners.values() if len(modules) > 1 for m in modules]
    packed = [m for m in shared if hasattr(m, "cpu_linear") and hasattr(m, "quant_method")]
    for module in packed:  # the one that was loaded too: which of them vLLM loads is its model's choice
        module.quant_method.process_weights_after_loading(module)
    return len(packed)


class VllmEngine:
    """One colocated `vllm.LLM` per rank, or per group of `tensor_parallel_size` consecutive ranks.

    The engine joins the trainer's process group through vLLM's `external_launcher`
    backend: it reads RANK / LOCAL_RANK and sits on the rank's own device (the default
    uni-process executor would put every rank's engine on cuda:0). With tensor
    parallelism, the ranks of a group build one engine together and `generate` is
    collective within the group: every member submits the group's requests in the
    same order and keeps its own share of the outputs.
    """

    def __init__(
        self,
        model_dir: str,
        *,
        tokenizer=None,
        dtype: str,
        max_model_len: int,
        seed: int,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.4,
        cpu_kv_cache_gb: float = 0.25,
        enable_sleep_mode: bool = True,
        enable_prefix_caching: bool = True,
        hf_overrides: dict | None = None,
        stop_token_ids: list[int] | None = None,
        sampled_logprobs: bool = False,
        max_num_seqs: int | None = None,
    ):
        # The process environment (an in-process engine: VLLM_ENABLE_V1_MULTIPROCESSING=0) is set
        # by the entry point, see trapo/runtime.py.
        import numpy as np
        import torch
        import torch.distributed as torch_dist
        from vllm import LLM

        self.on_gpu = torch.cuda.is_available()
        self.tensor_parallel_size = tensor_parallel_size
        self.stop_token_ids = list(stop_token_ids or [])
        self.sampled_logprobs = sampled_logprobs
        kwargs = dict(
            model=model_dir,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            enable_prefix_caching=enable_prefix_caching,
            tensor_parallel_size=tensor_parallel_size,
            # Log-probs of the distribution each token was drawn from (after temperature and top-p),
            # comparable with the trainer's log-probs at the sampling temperature.
            logprobs_mode="processed_logprobs",
        )
        self.group = None
        if torch_dist.is_initialized():
            kwargs["distributed_executor_backend"] = "external_launcher"
            from trapo.engine import dist

            self.group = dist.tensor_parallel_group(tensor_parallel_size)
        elif tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size > 1 needs a launcher (torch.distributed) with that many ranks")
        if hf_overrides:
            kwargs["hf_overrides"] = hf_overrides  # rope_parameters etc., as the policy uses
        if max_num_seqs:
            # The engine's batch is the config's (questions per engine x G), not vLLM's serving default of
            # 1,024 sequences; CUDA graphs are captured up to that size, not to 512, so their pool is smaller.
            kwargs["max_num_seqs"] = max_num_seqs
            if self.on_gpu:
                kwargs["compilation_config"] = {"max_cudagraph_capture_size": max_num_seqs}
        if self.on_gpu:
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode)
        else:
            # The CPU backend sizes its KV cache from this, not from a memory fraction;
            # CUDA graphs / compilation do not apply.
            kwargs.update(kv_cache_memory_bytes=int(cpu_kv_cache_gb * 2**30), enforce_eager=True)
            # vLLM 0.32 rewinds a seeded request's generator after a partial (chunked) prefill,
            # which CPU generators cannot do ("CPU Generator does not use offset"): prefill whole prompts.
            kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, 4096))
            if tensor_parallel_size > 1:  # left by an earlier run's os._exit or kill; every rank, then all wait
                remove_stale_cpu_shm()
                torch_dist.barrier()
        # vLLM's workers reseed Python's, NumPy's, torch's and every CUDA generator while the engine is
        # built (vllm/utils/torch_utils.py set_random_seed, called from v1/worker/cpu_worker.py and
        # gpu_worker.py): keep all of the trainer's streams as they were.
        python_state, numpy_state = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if self.on_gpu else []):
            self.llm = LLM(**kwargs)
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        self.weights_asleep = self.kv_asleep = False
        self.sleep_enabled = self.on_gpu and enable_sleep_mode
        self.check_placement()
        # Every engine parameter and vLLM's fused modules (q/k/v -> qkv_proj, gate/up -> gate_up_proj),
        # to check that a push reaches them all (the names are the same on every tensor-parallel rank).
        (engine_params,) = {
            json.dumps(names)  # hashable, so the set checks every tensor-parallel rank reports the same
            for names in self.llm.apply_model(
                lambda model: [[n for n, _ in model.named_parameters()], getattr(model, "packed_modules_mapping", {})]
            )
        }
        self._engine_names, self._engine_packed = json.loads(engine_params)
        self.tokenizer = tokenizer if tokenizer is not None else self.llm.get_tokenizer()

    # ------------------------------------------------------------------ what the engine runs

    def device(self) -> str:
        """The device the engine's weights sit on, e.g. "cuda:3" or "cpu"."""
        (device,) = set(self.llm.apply_model(lambda model: str(next(model.parameters()).device)))
        return device

    def check_placement(self) -> None:
        """The engine must sit on this rank's own device: cuda:LOCAL_RANK on GPU, the CPU otherwise."""
        expected = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if self.on_gpu else "cpu"
        found = self.device()
        if found != expected:
            raise RuntimeError(
                f"vLLM engine of rank {os.environ.get('RANK', '0')} sits on {found}, expected {expected} "
                "(LOCAL_RANK); check CUDA_VISIBLE_DEVICES and the launcher"
            )

    def effective_config(self) -> dict:
        """What the engine's model uses: RoPE theta (read off its rotary embedding), positions, vocab, dtype."""

        def rope_base(model) -> float:
            rotary = next(m for m in model.modules() if hasattr(m, "cos_sin_cache") and hasattr(m, "base"))
            return float(rotary.base)

        (theta,) = set(self.llm.apply_model(rope_base))
        mc = self.llm.llm_engine.model_config
        return {
            "rope_theta": theta,
            "max_position_embeddings": mc.hf_text_config.max_position_embeddings,
            "vocab_size": mc.get_vocab_size(),
            "dtype": str(mc.dtype).removeprefix("torch."),
        }

    # ------------------------------------------------------------------ sampling

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        temperature: float,
        top_p: float = 1.0,
        max_tokens: int,
        seeds: list[int] | None = None,
        min_tokens: int = 0,
    ) -> list[list[Rollout]]:
        """n samples per prompt. With `seeds` (one per prompt) sampling depends
        only on the seed and the weights, not on batch composition, so a resumed
        run draws the same rollouts. Returns [len(prompts)][n].

        Collective within a tensor-parallel group: the members' requests are
        gathered (identical lists count once) and each member gets its own back.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.weights_asleep:
            raise RuntimeError("generate: the engine is asleep (its weights were released); push weights first")
        if self.kv_asleep:  # woken only now: until here the trainer's states had the memory
            self.llm.wake_up(tags=["kv_cache"])
            self.kv_asleep = False
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"generate: {len(seeds)} seeds for {len(prompts)} prompts")
        requests, mine = self._group_requests(prompts, seeds)
        params = [
            SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_tokens,
                min_tokens=min_tokens,
                seed=seed,
                stop_token_ids=self.stop_token_ids,
                logprobs=0 if self.sampled_logprobs else None,  # 0: the sampled token's own only
                detokenize=False,  # decoded below, once for the whole call
            )
            for _, seed in requests
        ]
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p, _ in requests], params, use_tqdm=False
        )  # one RequestOutput per request, in order
        groups = [out.outputs for out in outputs[mine]]
        responses = [list(c.token_ids) for group in groups for c in group]
        texts = iter(decode_responses(self.tokenizer, responses, self.stop_token_ids))
        return [[self._rollout(c, next(texts)) for c in group] for group in groups]

    def _group_requests(self, prompts, seeds) -> tuple[list[tuple], slice]:
        """(the requests every member of the group submits, this rank's slice of them)."""
        own = list(zip(prompts, seeds if seeds is not None else [None] * len(prompts)))
        if self.group is None or self.group.size == 1:
            return own, slice(None)
        from trapo.engine import dist

        members = dist.all_gather(own, group=self.group.handle)
        if all(m == own for m in members):  # the same requests on every member (e.g. greedy evaluation)
            return own, slice(None)
        start = sum(len(m) for m in members[: self.group.rank])
        return [r for m in members for r in m], slice(start, start + len(own))

    def _rollout(self, completion, text: str) -> Rollout:
        logprobs = None
        if self.sampled_logprobs and completion.logprobs is not None:
            logprobs = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]
        return Rollout(list(completion.token_ids), text, completion.finish_reason == "length", logprobs)

    # ------------------------------------------------------------------ weights and memory

    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load Hugging Face-named tensors into the engine in place; wakes a sleeping engine's weights.

        Returns the bytes pushed. The iterator may gather lazily; vLLM
        fuses q/k/v and gate/up itself (`is_checkpoint_format=True`). Every
        parameter must come: after a level-2 sleep the engine holds no weights,
        and vLLM only logs a parameter that received nothing
        (model_executor/model_loader/reload/inplace.py, "were not loaded"), so
        a missing one is an error here. The KV cache stays asleep until the
        next `generate`: the trainer's states are back on the device meanwhile.
        """
        pushed, names = [0], set()
        if faults.hit("push_noise"):  # a corrupted push, for rollout.health's test (trapo/faults.py)
            named_tensors = faults.noisy(named_tensors)

        def counted():
            for name, tensor in named_tensors:
                pushed[0] += tensor.numel() * tensor.element_size()
                names.add(name)
                yield name, tensor

        if self.weights_asleep:
            self.llm.wake_up(tags=["weights"])
            self.weights_asleep = False
        self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=counted(), is_checkpoint_format=True))
        if not self.on_gpu:  # only the CPU backend multiplies by packed copies of the weights
            self.llm.apply_model(repack_shared_weights)
        missing = unpushed(self._engine_names, self._engine_packed, names)
        if missing:
            raise RuntimeError(
                f"weight push: {len(missing)} engine parameter(s) received no tensor, e.g. {missing[0]}; the engine "
                "would sample from stale or released weights (the policy's parameter names do not match the engine's)"
            )
        # Cached prefixes were computed with the old weights.
        self.llm.reset_prefix_cache()
        return pushed[0]

    @contextlib.contextmanager
    def turn(self):
        """A stretch of generation (a round's rollouts, an evaluation); on GPU the engine sleeps after it."""
        try:
            yield self
        finally:
            self.sleep()

    def describe(self, devices: list[str]) -> str:
        return f"vLLM engines (tensor parallel {self.tensor_parallel_size}): " + ", ".join(
            f"rank {i} {d}" for i, d in enumerate(devices)
        )

    def sleep(self) -> None:
        """GPU: release the weights and the KV cache while the policy trains (level 2).

        Level 1 would copy every weight to host memory and back only for the push
        to overwrite them; level 2 drops them (vLLM keeps the model's buffers, such
        as the rotary tables) and the next `push_weights` refills them. The KV
        cache comes back at the next `generate`, at the size vLLM gave it when the
        engine was built (v1/worker/gpu_worker.py sizes it once; `wake_up` maps
        the same pool again, device_allocator/cumem.py): sleeping frees memory for
        the update, it never makes the cache larger.
        """
        if self.sleep_enabled and not (self.weights_asleep and self.kv_asleep):
            self.llm.sleep(level=2)
            self.weights_asleep = self.kv_asleep = True
