"""The hf rollout backend (`rollout.backend: hf`): the policy's own transformers model generates.

No second copy of the weights and nothing to push after an update: the engine is the policy. It needs no
vLLM, so it runs where vLLM does not build (a new CUDA, a new GPU generation, ROCm) or is not installed.

- ZeRO-3: the parameters are gathered once per turn (`dist.gathered_for_generation`: a round's rollouts, an
  evaluation), not once per forward, and partitioned again after it.
- Batched: up to `max_batch` sequences at once (the G samples of several questions), left-padded, with a
  KV cache; longest prompts first, so a batch's prompts are of similar length. Finished sequences leave the
  batch (and the cache) once a quarter of it has finished, so the long tail runs on a small batch.
- Prefilled in groups of whole prompts, at most `prefill_tokens` tokens (padding included) per forward, the
  groups' KV caches then joined: one forward of 256 prompts of 1,024 tokens would hold 9.9 GB per
  [tokens, intermediate] MLP tensor at 7B, three at once. The memory plan counts one group's (`_prefill`).
- Sampling as vLLM does it: temperature, then top-p, and the sampled token's log-prob under that processed
  distribution (`processed_logprobs`), which the trainer compares with its own (logprob_diff_rollout_vs_policy).
- Seeded per request: token t of sample j of a request is drawn with a uniform that is a hash of (the
  request's seed, j, t), so a sample depends on its seed and the weights only, never on the other requests
  in the batch: a resumed run and a repeated evaluation draw the same responses (`sample_tokens`).
"""

from __future__ import annotations

import contextlib

import torch

from trapo import console
from trapo.engine import decoding, dist, static_decoding
from trapo.engine.memory_terms import HF_PREFILL_TOKENS
from trapo.engine.rollout import Rollout, decode_responses, request_seed

MASK32 = 0xFFFFFFFF
_COMPACT_SHARE = 0.25  # finished share of a batch at which it is compacted


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' "lowbias32") of an int64 tensor holding values in [0, 2^32).

    Multiplications are split into 16-bit halves of the constant, so no intermediate passes 2^63
    (no reliance on signed overflow wrapping)."""

    def mul(v: torch.Tensor, c: int) -> torch.Tensor:
        return ((((v * (c >> 16)) & 0xFFFF) << 16) + v * (c & 0xFFFF)) & MASK32

    x = x ^ (x >> 16)
    x = mul(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = mul(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_draws(keys: torch.Tensor, step: int) -> torch.Tensor:
    """[b] uniforms in (0, 1) in float64, a pure function of (key, step): 48 bits from two hashes."""
    first = mix32((keys + step * 0x9E3779B1) & MASK32)
    second = mix32(first ^ 0x85EBCA6B)
    return ((first >> 8).double() + ((second >> 8).double() + 0.5) / float(1 << 24)) / float(1 << 24)


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """logits [b, V] with every token outside the nucleus set to -inf: the most likely tokens whose mass
    reaches top_p (the token that crosses it included; at least one token)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    mass_before = sorted_logits.softmax(-1).cumsum(-1) - sorted_logits.softmax(-1)  # mass of the tokens above
    drop_sorted = mass_before >= top_p
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_tokens(
    logits: torch.Tensor, *, temperature: float, top_p: float, keys: torch.Tensor, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its log-prob under the distribution it was drawn from.

    logits [b, V] (fp32); keys [b] int64 in [0, 2^32): each row's sample key; step: the token's index in
    its response. temperature 0: greedy, with the log-prob of the unscaled distribution. Otherwise
    p = softmax(top_p_filter(logits / T)) and the token is drawn by inverting p's cumulative sum at one
    uniform from `uniform_draws` (no generator state; one draw per row, not one per vocabulary entry).
    A token of probability 0 (outside the nucleus) is never drawn. Returns (tokens [b], logprobs [b]).
    """
    if temperature == 0:
        logp = logits.log_softmax(-1)
        tokens = logp.argmax(-1)
        return tokens, logp.gather(-1, tokens[:, None])[:, 0]
    logp = top_p_filter(logits / temperature, top_p).log_softmax(-1)
    cdf = logp.exp().cumsum(-1)  # [b, V]
    total = cdf[:, -1]
    target = (uniform_draws(keys, step) * total.double()).to(cdf.dtype)  # [b]
    # Strictly below the total (fp32 rounding could reach it), so some token's cdf passes the target, and the
    # first one that does rose there: its probability is > 0 (a token outside the nucleus never is drawn).
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]  # first token whose cdf passes it
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]


class EagerSteps:
    """The decode loop's steps as transformers runs them, one kernel launch at a time: a cache that grows in
    place (decoding.ReservedLayer; a sliding-window model's as transformers builds it), a mask sliced to the
    filled length, and the batch compacted to its live rows once a quarter of it has finished."""

    check_every = 1  # rows finished are counted every step

    def __init__(self, engine: HfEngine):
        self.engine = engine

    def start(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, max_tokens: int) -> torch.Tensor:
        b, self.width = ids.shape
        self.cache, logits = self.engine._prefill(ids, mask, positions)
        if self.engine.joinable_cache:  # room for the whole response: no copy of the cache per token
            self.cache = decoding.reserve(self.cache, self.width + max_tokens)
        self.mask = torch.cat([mask, mask.new_ones((b, max_tokens))], dim=1)  # sliced to the filled length
        return logits

    def compact(self, done: torch.Tensor, finished: int) -> torch.Tensor | None:
        if finished < _COMPACT_SHARE * len(done):
            return None
        keep = (~done).nonzero()[:, 0]
        self.cache.batch_select_indices(keep)
        self.mask = self.mask[keep]
        return keep

    def step(self, token: torch.Tensor, position: torch.Tensor, t: int) -> torch.Tensor:
        out = self.engine.model(
            input_ids=token[:, None],
            attention_mask=self.mask[:, : self.width + t + 1],
            position_ids=position[:, None],
            past_key_values=self.cache,
            use_cache=True,
        )
        return out.logits[:, -1]


class HfEngine:
    """Generation with a transformers causal LM: the policy's module under DeepSpeed in training (pass its
    DeepSpeed engine as `zero3_engine`), or a plain model in `trapo eval`."""

    weights_asleep = False  # nothing is ever released: the weights are the policy's

    def __init__(
        self,
        model,
        tokenizer,
        *,
        stop_token_ids: list[int],
        max_batch: int = 256,
        prefill_tokens: int = HF_PREFILL_TOKENS,
        zero3_engine=None,
        decoding: str = "auto",
    ):
        self.model, self.tokenizer = model, tokenizer
        self.stop_token_ids = list(stop_token_ids)
        self.max_batch = max_batch
        self.prefill_tokens = prefill_tokens
        self.zero3_engine = zero3_engine
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        # A sliding-window cache layer keeps only its window, which joining prefill groups would not rebuild
        self.joinable_cache = all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.stop_token_ids or [0])[0]
        self._static = {}  # the static path's buffers (StaticKV), kept from one batch to the next of a turn
        self._runner = None  # how the static path's steps run (static_decoding.step_runner); None: eager
        self.set_decoding(decoding)
        self._turns = 0  # open turns (a turn inside a turn gathers nothing more)
        self._calls = 0  # generate calls without seeds: their requests are keyed by this count

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str,
        tokenizer,
        *,
        dtype: str,
        stop_token_ids: list[int],
        max_batch: int = 256,
        overrides: dict | None = None,
        decoding: str = "auto",
    ):
        """A plain model (no DeepSpeed) on this process's GPU, or the CPU: what `trapo eval --backend hf` runs.
        `overrides`: config attributes set over the checkpoint's (trapo.engine.policy.model_overrides)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        from trapo.runtime import torch_dtype

        config = AutoConfig.from_pretrained(model_dir)
        for key, value in (overrides or {}).items():
            setattr(config, key, value)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch_dtype(dtype)).to(device)
        return cls(model.eval(), tokenizer, stop_token_ids=stop_token_ids, max_batch=max_batch, decoding=decoding)

    # ------------------------------------------------------------------ what the engine runs

    def device(self) -> str:
        return str(next(self.model.parameters()).device)

    def effective_config(self) -> None:
        """None: no copy of the weights to compare, the engine generates with the model it was given."""
        return None

    def describe(self, devices: list[str]) -> str:
        ranks = ", ".join(f"rank {i} {d}" for i, d in enumerate(devices))
        return (
            f"hf rollouts: each rank generates with its own policy model (no engine copy, no weight push): {ranks}; "
            f"decoding {self.decoding} ({self.decoding_why})"
        )

    def push_weights(self, named_tensors) -> int:
        """Nothing to push: the engine is the policy. The iterator is not consumed (no gathering happens)."""
        return 0

    @contextlib.contextmanager
    def turn(self):
        """A stretch of generation: the ZeRO-3 parameters whole on every rank (collective), no gradients, the
        model in eval mode (no dropout, no gradient checkpointing) with sdpa attention that reads the
        left-padding mask and grouped heads in place (trapo/engine/decoding.py; packed training rows use
        trapo/engine/packing.py's kernel); restored after."""
        if self._turns:
            yield self
            return
        model = self.model
        was_training, attention = model.training, model.config._attn_implementation
        gather = dist.gathered_for_generation(self.zero3_engine) if self.zero3_engine else contextlib.nullcontext()
        with gather, torch.no_grad(), dist.plain_linear_forward():
            model.eval()
            static = self._runner is not None
            model.set_attn_implementation(
                static_decoding.register_static_attention() if static else decoding.register_decode_attention()
            )
            self._turns += 1
            try:
                yield self
            finally:
                self._turns -= 1
                self._end_static_turn()
                model.set_attn_implementation(attention)
                model.train(was_training)

    def set_decoding(self, decoding: str) -> None:
        """Decode as `decoding` (rollout.hf_decoding) says from the next batch on, resolved for this model and
        device (`static_decoding.resolve`): `requested`, `decoding` and why; the static path's buffers and
        captures so far are dropped."""
        self._end_static_turn()
        self.requested = decoding  # auto: a static path that fails falls back to eager (_generate_or_fall_back)
        self.decoding, self.decoding_why = static_decoding.resolve(decoding, self.device(), self.model)
        self._runner = static_decoding.step_runner(self.decoding, self.model)

    def _end_static_turn(self) -> None:
        """The static path's buffers and captured steps go with the turn: the update needs the memory, and a
        ZeRO-3 model's gathered weights, whose addresses the captures hold, are released with it."""
        self._static.clear()
        if self._runner is not None:
            self._runner.reset()

    def _steps(self):
        if self._runner is None:
            return EagerSteps(self)
        return static_decoding.StaticSteps(self.model, self._prefill, self._runner, self._static)

    # ------------------------------------------------------------------ sampling

    @torch.no_grad()
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
        """n samples per prompt, [len(prompts)][n]. Sample j of a prompt with seed s is drawn with the key
        request_seed(s, j): the same on every rank, in every batch. Without seeds, the keys follow this
        engine's count of unseeded calls (reproducible from a fresh engine, as vLLM's engine seed is)."""
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"generate: {len(seeds)} seeds for {len(prompts)} prompts")
        if seeds is None:
            seeds = [request_seed("unseeded", self._calls, i) for i in range(len(prompts))]
            self._calls += 1
        requests = [(i, j) for i in range(len(prompts)) for j in range(n)]
        keys = [request_seed(seeds[i], j) for i, j in requests]
        order = sorted(range(len(requests)), key=lambda k: (-len(prompts[requests[k][0]]), k))
        sampled: list = [None] * len(requests)
        with self.turn():
            for start in range(0, len(order), self.max_batch):
                chunk = order[start : start + self.max_batch]
                outs = self._generate_or_fall_back(
                    [prompts[requests[k][0]] for k in chunk],
                    [keys[k] for k in chunk],
                    temperature=temperature,
                    top_p=top_p,
                    max_tokens=max_tokens,
                    min_tokens=min_tokens,
                )
                for k, out in zip(chunk, outs):
                    sampled[k] = out
        texts = decode_responses(self.tokenizer, [ids for ids, _, _ in sampled], self.stop_token_ids)
        rollouts = [Rollout(ids, text, cut, lps) for (ids, lps, cut), text in zip(sampled, texts)]
        return [rollouts[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _generate_or_fall_back(self, prompts: list[list[int]], keys: list[int], **sampling):
        """`_generate_batch`; under auto, a static step that fails (a model whose forward the static path does not
        fit) is said once and the batch is generated again eagerly, as every later one: a sample depends on its key
        and the weights only, so the batch's results are eager decoding's."""
        try:
            return self._generate_batch(prompts, keys, **sampling)
        except Exception as error:  # noqa: BLE001 - under auto only; an explicit choice raises as it is
            if self._runner is None or self.requested != "auto":
                raise
            why = f"{type(error).__name__}: {str(error)[:200]}"
            console.warn_once("static-decoding", f"hf decoding: the static steps failed ({why}); decoding eagerly")
            self.set_decoding("eager")
            self.decoding_why = f"auto: the static steps failed ({why})"
            self.model.set_attn_implementation(decoding.register_decode_attention())  # the turn restores its own
            return self._generate_batch(prompts, keys, **sampling)

    def _generate_batch(
        self,
        prompts: list[list[int]],
        keys: list[int],
        *,
        temperature: float,
        top_p: float,
        max_tokens: int,
        min_tokens: int = 0,
    ) -> list[tuple[list[int], list[float], bool]]:
        """(token ids, log-probs, truncated) per prompt: one left-padded batch with a KV cache."""
        device = torch.device(self.device())
        b, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[row, width - len(p) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # each prompt's own positions from 0, as in training
        stops = torch.tensor(self.stop_token_ids or [-1], device=device)
        held_back = torch.tensor(self.stop_token_ids, dtype=torch.long, device=device)  # before min_tokens
        keys_t = torch.tensor(keys, dtype=torch.int64, device=device)
        tokens = torch.full((b, max_tokens), -1, dtype=torch.long, device=device)  # -1 after a row's end
        logprobs = torch.zeros((b, max_tokens), dtype=torch.float32, device=device)
        rows = torch.arange(b, device=device)  # the batch row each live row stands for
        done = torch.zeros(b, dtype=torch.bool, device=device)  # finished, still in the batch until compaction
        steps = self._steps()
        logits = steps.start(ids, mask, positions, max_tokens)
        position = positions[:, -1] + 1
        for t in range(max_tokens):
            logits = logits.float()
            if t < min_tokens:  # stop tokens get probability 0 (vLLM's min_tokens does the same)
                logits = logits.index_fill(-1, held_back, float("-inf"))
            token, lp = sample_tokens(logits, temperature=temperature, top_p=top_p, keys=keys_t[rows], step=t)
            tokens[rows, t] = torch.where(done, -1, token)  # no boolean indexing: no host sync per step
            logprobs[rows, t] = torch.where(done, 0.0, lp)
            done = done | torch.isin(token, stops)
            if t + 1 == max_tokens:
                break
            if t % steps.check_every == 0:
                finished = int(done.sum())  # the one host synchronisation (model.generate has one per step)
                if finished == len(rows):
                    break
                keep = steps.compact(done, finished)  # finished rows out of the batch and the cache
                if keep is not None:
                    rows, done, token, position = rows[keep], done[keep], token[keep], position[keep]
            logits = steps.step(token, position, t)
            position = position + 1
        results = []
        stop_set = set(self.stop_token_ids)
        for row_tokens, row_lps in zip(tokens.tolist(), logprobs.tolist()):
            length = row_tokens.index(-1) if -1 in row_tokens else max_tokens
            kept = row_tokens[:length]
            results.append((kept, row_lps[:length], length == max_tokens and kept[-1] not in stop_set))
        return results

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor):
        """(the prompts' KV cache, each row's last logits [b, V]): forwards of whole rows, at most
        `prefill_tokens` tokens each (a longer prompt goes alone), every row with the batch's padding, mask and
        positions, so it computes what one forward of the batch would; the groups' caches are then joined."""
        from transformers import DynamicCache

        config = self.model.config
        per_forward = max(1, self.prefill_tokens // ids.shape[1]) if self.joinable_cache else len(ids)
        parts, logits = [], []
        for start in range(0, len(ids), per_forward):
            part, group = DynamicCache(config=config), slice(start, start + per_forward)
            out = self.model(
                input_ids=ids[group],
                attention_mask=mask[group],
                position_ids=positions[group],
                past_key_values=part,
                use_cache=True,
                logits_to_keep=1,
            )
            parts.append(part)
            logits.append(out.logits[:, -1])
        if len(parts) == 1:
            return parts[0], logits[0]
        cache = DynamicCache(config=config)
        for layer in range(len(parts[0].layers)):
            keys = torch.cat([part.layers[layer].keys for part in parts])
            values = torch.cat([part.layers[layer].values for part in parts])
            for part in parts:
                part.layers[layer].reset()  # each group's copy freed as soon as the batch's is made
            cache.update(keys, values, layer)
        return cache, torch.cat(logits)
