"""The hf backend's static decode path (`rollout.hf_decoding`): a KV cache sized once, every decode step a
forward of fixed shapes over buffers whose addresses never change, so the step can be captured once and
replayed (CUDA graphs) instead of launching a few hundred small kernels from Python per token.

- `StaticKV` holds one key and one value buffer per layer, [rows, kv_heads, length, head_dim], and the step's
  inputs (token, position, attention mask, the slot being written). It lives for a turn of generation (the
  engine drops it and its captured steps at the turn's end: the update needs the memory, and ZeRO-3 gathers
  the weights at new addresses each turn) and grows, dropping the captures, only when a batch of the turn
  needs more rows or positions than it has.
- A batch runs at a bucket of rows (`BUCKETS`: no more than a third of them padding) and attends over a span
  of the cache (`span_for`: multiples of SPAN, coarser as the context grows), so a few dozen captured shapes
  serve every step. Every shape writes its logits into one buffer, so a captured shape keeps no memory of its
  own beyond the graph. Finished rows leave
  the batch when the live ones fit a smaller bucket: they are copied to the front of the buffers.
- Left padding puts every row's token t in the same slot (prompt width + t); the mask says which slots each
  row attends to (4D, so transformers builds no mask of its own). Padded rows of a bucket hold earlier rows'
  values: finite, never read by a live row.
- `step_runner`: how a step runs. `static` calls it (the CPU path, and the reference the others must equal),
  `cuda_graph` captures it with torch.cuda.CUDAGraph per (rows, span), `compile` hands it to
  torch.compile(mode="reduce-overhead"), which captures its own graphs. Under `auto` a capture the
  device refuses is said once and the engine decodes eagerly from then on (its label says eager).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from trapo import console
from trapo.config import HF_DECODINGS, ConfigError
from trapo.engine import decoding

SPAN = 64  # cache positions a captured step attends over come in multiples of this
# Batch sizes the steps are captured for: powers of two and their halfway points (at most a third padding)
BUCKETS = sorted({1, 2, 3} | {m * 2**k for k in range(1, 12) for m in (2, 3)})
CHECK_EVERY = 4  # static steps between looks at how many rows finished (each look waits for the device)
STATIC_ATTENTION = "trapo_static_decode"


def bucket(rows: int) -> int:
    """The smallest bucket holding `rows` (a multiple of 1,024 beyond the last)."""
    for size in BUCKETS:
        if size >= rows:
            return size
    return -(-rows // 1024) * 1024


def span_for(filled: int, length: int) -> int:
    """Cache positions a step attends over when `filled` are written, at most `length`: a multiple of SPAN, or
    past 8 x SPAN of an eighth of the power of two below `filled` (at most an eighth more than filled; eight
    captured spans per doubling of the context, not one per SPAN)."""
    grain = max(SPAN, 2 ** (filled.bit_length() - 1) // 8)
    return min(length, -(-filled // grain) * grain)


# transformers' rotary updates that read max(position_ids) + 1 on the host and branch on it
# (modeling_rope_utils.dynamic_rope_update: any type with "dynamic" in its name, and "longrope"): inside a
# captured step that is a sync the capture refuses, or a graph frozen at one branch.
HOST_ROPE = ("dynamic", "longrope")


def rope_types(model) -> set[str]:
    """The rotary types `model` runs: its rotary modules' `rope_type` (a name, or one per layer type), which
    transformers' rotary update reads."""
    types: set[str] = set()
    for module in model.modules():
        kind = getattr(module, "rope_type", None)
        if isinstance(kind, dict):
            types.update(v for v in kind.values() if isinstance(v, str))
        elif isinstance(kind, str):
            types.add(kind)
    return types


def static_supported(model) -> str | None:
    """None if `model` can decode statically, else why not. Every layer must attend to all earlier positions
    (full causal attention: a sliding window's or a chunk's cache keeps only part of them, and the static step's
    attention reads the whole span), and its rotary embedding must not read positions on the host (HOST_ROPE).
    The step's mask is 4D, which transformers' mask functions (create_causal_mask, in the Llama and Qwen
    families) return as they got it."""
    config = model.config
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        return f"layer types {sorted(types)}: only full attention decodes statically"
    if not getattr(config, "layer_types", None) and getattr(config, "sliding_window", None) is not None:
        return f"sliding_window={config.sliding_window}: only full attention decodes statically"
    if getattr(config, "attention_chunk_size", None) is not None:
        return f"attention_chunk_size={config.attention_chunk_size}: only full attention decodes statically"
    host = sorted(t for t in rope_types(model) if any(h in t for h in HOST_ROPE))
    if host:
        return f"rope type {', '.join(host)} reads the positions on the host each step, which a capture cannot"
    return None


def resolve(decoding: str, device: str, model) -> tuple[str, str]:
    """(the decode path to run, why): `auto` is cuda_graph on a CUDA device for a model that decodes
    statically, eager elsewhere; an explicit choice is checked against the device and the model."""
    if decoding not in HF_DECODINGS:
        raise ConfigError(f"rollout.hf_decoding: {decoding!r} is not one of {', '.join(HF_DECODINGS)}")
    why_not = static_supported(model)
    cuda = device.startswith("cuda")
    if decoding == "auto":
        if not cuda:
            return "eager", "auto: no CUDA device, nothing to capture"
        if why_not:
            return "eager", f"auto: {why_not}"
        return "cuda_graph", "auto: a CUDA device and a model that decodes statically"
    if decoding != "eager" and why_not:
        raise ConfigError(f"rollout.hf_decoding={decoding}: {why_not}; use eager")
    require_device(decoding, device)
    return decoding, "as configured"


def require_device(decoding: str, device: str) -> None:
    """A ConfigError where `decoding` (rollout.hf_decoding) cannot run on `device` ("cuda:0", "cpu"): the
    captured paths need CUDA. The trainer asks before any model loads, the engine again when it opens."""
    if decoding in ("cuda_graph", "compile") and not device.startswith("cuda"):
        raise ConfigError(f"rollout.hf_decoding={decoding} captures CUDA graphs and needs a CUDA device, got {device}")


def static_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
    """Attention of one query token per row over the cache's span, grouped heads read in place: two batched
    matrix products, no copy of the cache, no data-dependent branch (capturable). query [b, heads, 1, d];
    key, value [b, kv_heads, span, d]; attention_mask [b, 1, 1, span] bool (True: attend). Scores and the
    softmax in fp32, as transformers' eager attention does; returns ([b, 1, heads, d], None)."""
    b, heads, q, d = query.shape
    if q != 1:  # the prefill: transformers' sdpa with its own mask
        return decoding.decode_attention(module, query, key, value, attention_mask, dropout, scaling, **kw)
    kv_heads = key.shape[1]
    # query head h reads key/value head h // groups (transformers' repeat_kv order)
    grouped = query.reshape(b, kv_heads, (heads // kv_heads) * q, d)
    scores = torch.matmul(grouped, key.transpose(-1, -2)).float() * scaling
    if attention_mask is not None:  # None: a one-token prompt's prefill, which sdpa's mask function left open
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    out = torch.matmul(scores.softmax(-1).to(value.dtype), value)
    return out.reshape(b, heads, q, d).transpose(1, 2).contiguous(), None


def register_static_attention() -> str:
    """Make `STATIC_ATTENTION` a transformers attention implementation, with sdpa's masks for the prefill."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(STATIC_ATTENTION, static_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(STATIC_ATTENTION, sdpa_mask)
    return STATIC_ATTENTION


class SlotLayer(CacheLayerMixin):
    """One layer's cache for a static step: writes the step's keys and values at the shared slot of its
    buffers' first `rows` rows and hands attention the first `span` positions of those rows."""

    is_compileable = True
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slot: torch.Tensor):
        super().__init__()
        self.buffers, self.slot = (keys, values), slot
        self.rows, self.span = keys.shape[0], keys.shape[2]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = (buffer[: self.rows] for buffer in self.buffers)
        keys.index_copy_(2, self.slot, key_states)
        values.index_copy_(2, self.slot, value_states)
        return keys[:, :, : self.span], values[:, :, : self.span]

    def get_seq_length(self) -> int:
        return self.span

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.span, 0

    def get_max_length(self) -> int:
        return self.buffers[0].shape[2]

    def lazy_initialization(self, key_states, value_states) -> None:
        raise NotImplementedError("SlotLayer: its buffers are given, never made from the first update")


class StaticKV:
    """The buffers of static decoding: per layer keys and values [rows, kv_heads, length, head_dim], and the
    step's inputs: token and position [rows, 1], mask [rows, 1, 1, length] (bool), slot [1]."""

    def __init__(self, layers: int, rows: int, kv_heads: int, length: int, head_dim: int, dtype, device):
        shape = (rows, kv_heads, length, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.token = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.position = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.mask = torch.zeros((rows, 1, 1, length), dtype=torch.bool, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.logits = None  # [rows, V], made from the prefill's logits before any capture (`hold_logits`)
        self.rows, self.length, self.kv_heads, self.head_dim, self.dtype = rows, length, kv_heads, head_dim, dtype
        self.cache = Cache(layers=[SlotLayer(k, v, self.slot) for k, v in zip(self.keys, self.values)])

    def holds(self, layers: int, rows: int, kv_heads: int, length: int, head_dim: int, dtype) -> bool:
        return (len(self.keys), kv_heads, head_dim, dtype) == (layers, self.kv_heads, self.head_dim, self.dtype) and (
            rows <= self.rows and length <= self.length
        )

    def hold_logits(self, like: torch.Tensor) -> None:
        """The steps' logits buffer, [rows, V] in the dtype of `like` (the prefill's last logits)."""
        if self.logits is None or self.logits.shape[1:] != like.shape[1:] or self.logits.dtype != like.dtype:
            self.logits = like.new_empty((self.rows, *like.shape[1:]))

    def view(self, rows: int, span: int) -> None:
        for layer in self.cache.layers:
            layer.rows, layer.span = rows, span

    def keep(self, indices: torch.Tensor, filled: int) -> None:
        """Rows `indices` moved to the front of every buffer, in order: a copy of the rows kept, of the cache's
        first `filled` positions (the rest is written before it is read)."""
        n = len(indices)
        for buffer in [*self.keys, *self.values]:
            buffer[:n, :, :filled] = buffer[indices, :, :filled]
        self.mask[:n] = self.mask[indices]

    def mark_static(self) -> None:
        """Tell torch.compile the buffers' addresses never change (its graphs read them in place)."""
        for buffer in [*self.keys, *self.values, self.token, self.position, self.mask, self.slot, self.logits]:
            torch._dynamo.mark_static_address(buffer)


# ---------------------------------------------------------------------------------------------- step runners


class Called:
    """The step called as it is: static decoding without capture (CPU, and the reference for the others)."""

    def __call__(self, key, step):
        return step()

    def reset(self) -> None:
        pass


def cuda_graph_capture(step, pool, cuda=torch.cuda):
    """(replay, output, pool): `step` captured in a CUDA graph allocating from `pool` (None: a new one), after
    a warm-up run on a side stream (cuBLAS's workspace and lazy initializations happen outside the capture).
    The warm-up writes what the replay will write (the same inputs), so it changes nothing.

    The capture runs on a stream of its own, and the caller's stream is current again however it ends:
    torch.cuda.graph's exit ends the capture before it restores the stream, so a capture_end that raises (or
    a capture_begin that does) would leave the process on the capture stream. A step that fails mid-capture
    ends the capture before its error goes on. `cuda` is the seam a CPU test stands in for."""
    caller = cuda.current_stream()
    side = cuda.Stream()
    side.wait_stream(caller)
    with cuda.stream(side):
        step()
    caller.wait_stream(side)
    cuda.synchronize()  # as torch.cuda.graph does: nothing in flight, the allocator's free blocks returned
    cuda.empty_cache()
    graph, capturing = cuda.CUDAGraph(), cuda.Stream()
    capturing.wait_stream(caller)
    cuda.set_stream(capturing)
    try:
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")  # other threads' work is theirs
        try:
            output = step()
        except BaseException:
            with contextlib.suppress(Exception):  # the step's own error is the one to see
                graph.capture_end()
            raise
        graph.capture_end()
    finally:
        cuda.set_stream(caller)
    caller.wait_stream(capturing)
    return graph.replay, output, graph.pool()


class Captured:
    """Each (rows, span) step captured on first use, replayed after: its output is the same tensor every
    replay, read before the next. Every graph allocates from one pool (steps never overlap). A capture that
    fails raises: under `auto` the engine then decodes the batch and every later one eagerly
    (hf_rollout.HfEngine._generate_or_fall_back), never with uncaptured static steps, which are slower on a GPU
    than eager ones. `capture(step, pool) -> (replay, output, pool)` is the seam a CPU test stands in for."""

    def __init__(self, capture=cuda_graph_capture):
        self.capture, self.graphs, self.pool = capture, {}, None

    def __call__(self, key, step):
        if key not in self.graphs:
            replay, output, self.pool = self.capture(step, self.pool)
            self.graphs[key] = replay, output
        replay, output = self.graphs[key]
        replay()
        return output

    def reset(self) -> None:
        self.graphs.clear()
        self.pool = None


class Compiled:
    """The step through torch.compile(mode="reduce-overhead"): inductor's kernels, replayed as CUDA graphs it
    records per shape (a recompile per (rows, span), hence the raised limit).

    Inductor checks a recorded graph's inputs by address, and ZeRO-3 gathers the weights at new addresses each
    turn: left alone it would record every shape again each turn, counting each toward its re-record limit, and
    past it run the steps without graphs, logged only by torch. So the turn's end drops the recorded graphs on
    purpose (`reset`): each turn records each shape once, as the captured path captures, and the compiled
    kernels stay. A step inductor still runs without graphs is said once (its counter, `graph_skips`)."""

    def __init__(self, model, backend="inductor", fullgraph: bool = False):
        # another backend with fullgraph: traced as inductor would be, run without it (a CPU test's check
        # that the step has no graph break)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(BUCKETS))
        mode = "reduce-overhead" if backend == "inductor" else None
        self.forward = torch.compile(model.forward, mode=mode, backend=backend, fullgraph=fullgraph)
        self.skips = graph_skips()

    def __call__(self, key, step):
        return step(self.forward)

    def reset(self) -> None:
        """The turn's recorded graphs dropped (their memory freed for the update); a skip since the last turn
        said once."""
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees

        reset_cudagraph_trees()
        if graph_skips() > self.skips:
            console.warn_once(
                "compile-skips",
                f"hf decoding: torch.compile ran {graph_skips() - self.skips} decode steps without CUDA graphs "
                "(torch's cudagraphs log says why); rollout.hf_decoding=cuda_graph captures them itself",
            )
        self.skips = graph_skips()


def graph_skips() -> int:
    """Inductor's count of calls it ran without the CUDA graphs reduce-overhead asked for."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def step_runner(decoding: str, model):
    """How the static steps run for a resolved `decoding` (None: eager decoding, no static steps)."""
    if decoding == "eager":
        return None
    if decoding == "compile":
        return Compiled(model)
    return Captured() if decoding == "cuda_graph" else Called()


class StaticSteps:
    """The decode loop's steps on `StaticKV` (see the module docstring); the same interface as the eager
    steps (hf_rollout.EagerSteps): start (prefill), compact (finished rows out), step (one token)."""

    check_every = CHECK_EVERY

    def __init__(self, model, prefill, runner, kv_holder: dict):
        self.model, self.prefill, self.runner, self.holder = model, prefill, runner, kv_holder

    def _buffers(self, rows: int, length: int, like) -> StaticKV:
        layers, (_, kv_heads, _, head_dim) = len(like), like[0].keys.shape
        length = -(-length // SPAN) * SPAN
        kv = self.holder.get("kv")
        if kv is None or not kv.holds(layers, rows, kv_heads, length, head_dim, like[0].keys.dtype):
            if kv is not None:  # outgrown: every shape captured on it goes with it
                rows, length = max(rows, kv.rows), max(length, kv.length)
                self.runner.reset()
                self.holder["kv"] = kv = None  # the old buffers freed before the new ones are made
            kv = StaticKV(layers, rows, kv_heads, length, head_dim, like[0].keys.dtype, like[0].keys.device)
            self.holder["kv"] = kv
        return kv

    def start(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, max_tokens: int) -> torch.Tensor:
        b, width = ids.shape
        cache, logits = self.prefill(ids, mask, positions)
        self.rows = bucket(b)
        kv = self.kv = self._buffers(self.rows, width + max_tokens, cache.layers)
        kv.hold_logits(logits)
        if isinstance(self.runner, Compiled):
            kv.mark_static()
        for layer, keys, values in zip(cache.layers, kv.keys, kv.values):
            keys[:b, :, :width], values[:b, :, :width] = layer.keys, layer.values
            layer.reset()  # the prefill's copy freed layer by layer
        kv.mask[: self.rows] = False
        kv.mask[:b, 0, 0, :width] = mask.bool()
        kv.mask[b : self.rows, 0, 0, 0] = True  # padded rows attend somewhere: finite values, never NaN
        self.width = self.filled = width  # positions written
        return logits

    def compact(self, done: torch.Tensor, finished: int) -> torch.Tensor | None:
        """The live rows' indices when they fit a smaller bucket (and are moved to the buffers' front)."""
        live = len(done) - finished
        if bucket(live) >= self.rows:
            return None
        keep = (~done).nonzero()[:, 0]
        self.kv.keep(keep, self.filled)
        self.rows = bucket(live)
        return keep

    def step(self, token: torch.Tensor, position: torch.Tensor, t: int) -> torch.Tensor:
        kv, n, slot = self.kv, len(token), self.width + t
        kv.token[:n, 0] = token
        kv.position[:n, 0] = position
        kv.mask[: self.rows, 0, 0, slot] = True
        kv.slot.fill_(slot)
        self.filled = slot + 1
        rows, span = self.rows, span_for(slot + 1, kv.length)
        # the step reads only the buffers and the shapes bound here: a replay of its capture is the same step
        step = functools.partial(_forward, kv, rows, span)
        return self.runner((rows, span), lambda forward=self.model: step(forward))[:n]


def _forward(kv: StaticKV, rows: int, span: int, forward) -> torch.Tensor:
    """One decode step of `rows` rows attending over `span` positions of `kv`: the logits [rows, V], written into
    kv.logits (a captured step's own output is then freed at capture, not held per shape)."""
    kv.view(rows, span)
    out = forward(
        input_ids=kv.token[:rows],
        attention_mask=kv.mask[:rows, :, :, :span],  # 4D: transformers' mask functions hand it on as it is
        position_ids=kv.position[:rows],
        past_key_values=kv.cache,
        use_cache=True,
    )
    return kv.logits[:rows].copy_(out.logits[:, -1])
