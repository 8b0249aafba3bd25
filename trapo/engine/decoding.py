"""What the hf backend's decode loop runs on: a KV cache that grows in place, and attention that reads
grouped key/value heads where they are. Both remove a copy of the whole cache per generated token.

- transformers' DynamicLayer concatenates each token's keys and values onto the cache, so decoding T
  tokens copies the cache T times. `ReservedLayer` writes each token into a buffer reserved for the
  whole response and hands attention a view of the filled part: the same values, the same layout of the
  last two dimensions.
- transformers' sdpa attention repeats grouped key/value heads (repeat_kv: a copy of the cache per layer
  per token) whenever there is a padding mask, because CUDA's fused kernels cannot take both.
  `decode_attention` passes the single query token to torch's sdpa with `enable_gqa`, which reads each
  key/value head for its group of query heads; on CPU it returns the same tensors bit for bit
  (tests/engine/test_decoding.py checks both on this machine's kernels).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

DECODE_ATTENTION = "trapo_decode_sdpa"


class ReservedLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views of buffers with room for `capacity` positions.

    `keys`/`values` [b, heads, length, head_dim] stay what DynamicLayer's would be; a write past the
    capacity doubles the buffers (so a wrong estimate costs a copy, not a failure)."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    @classmethod
    def holding(cls, layer: DynamicLayer, capacity: int) -> ReservedLayer:
        """A reserved layer holding what `layer` (already filled, e.g. by a prefill) holds."""
        reserved = cls(max(capacity, layer.get_seq_length()))
        if layer.is_initialized and layer.keys is not None and layer.keys.numel():
            reserved.update(layer.keys, layer.values)
        return reserved

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self._keys = key_states.new_empty((*key_states.shape[:2], self.capacity, key_states.shape[3]))
        self._values = value_states.new_empty((*value_states.shape[:2], self.capacity, value_states.shape[3]))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            self._grow(max(end, 2 * self.capacity))
        self._keys[:, :, self.length : end] = key_states
        self._values[:, :, self.length : end] = value_states
        self.length = end
        self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
        return self.keys, self.values

    def _grow(self, capacity: int) -> None:
        keys, values = self._keys, self._values
        self.capacity = capacity
        self.lazy_initialization(keys, values)
        self._keys[:, :, : self.length] = keys[:, :, : self.length]
        self._values[:, :, : self.length] = values[:, :, : self.length]

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows `indices` of the batch (finished sequences leave it); one copy of the buffers."""
        if self.is_initialized:
            self._keys, self._values = self._keys[indices], self._values[indices]
            self.keys, self.values = self._keys[:, :, : self.length], self._values[:, :, : self.length]

    def reset(self) -> None:
        self._keys = self._values = None
        self.length = 0
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("ReservedLayer: the hf rollout backend never crops its cache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("ReservedLayer: the hf rollout backend never repeats its cache")


def reserve(cache, capacity: int):
    """`cache` (a DynamicCache of plain DynamicLayers, filled by a prefill) with each layer moved into a
    ReservedLayer with room for `capacity` positions; the same cache object is returned."""
    cache.layers = [ReservedLayer.holding(layer, capacity) for layer in cache.layers]
    return cache


def decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kw):
    """transformers' sdpa attention, except that one query token over grouped key/value heads reads them in
    place (`enable_gqa`) instead of repeating them. query [b, heads, q, d]; key, value [b, kv_heads, kv, d];
    returns ([b, q, heads, d], None) as transformers' attention functions do."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if groups == 1 or query.shape[2] != 1 or kw.get("position_bias") is not None:  # prefill: transformers' own
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kw
        )
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def register_decode_attention() -> str:
    """Make `DECODE_ATTENTION` a transformers attention implementation, with sdpa's masks (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(DECODE_ATTENTION, decode_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(DECODE_ATTENTION, sdpa_mask)
    return DECODE_ATTENTION
