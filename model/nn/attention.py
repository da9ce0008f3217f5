"""Grouped-query attention that never copies the keys and values per query head.

With grouped-query attention (SmolLM2: 9 query heads over 3 key/value heads) every key/value head
serves `rep` query heads. For one query token Hugging Face's SDPA path folds those heads into the
query length, but for T > 1 tokens (a verify step, a drafter block) it copies the keys and values
`rep` times (`repeat_kv`), or asks SDPA for `enable_gqa` under a mask, which the CPU kernels run
slowly. Folding the `rep × T` queries of a key/value head into one query axis does the same
arithmetic with no copy: measured on this CPU (bf16, one thread, 8 rows × 300 cached tokens, per
layer) it halves the attention of a T = 2..9 verify (1.2 → 0.55 ms at T = 2).

`packed_gqa_attention` is the kernel call; `ATTENTION_NAME` registers it with transformers so the
target's decoder layers use it (anything it cannot fold falls back to transformers' own SDPA).
`KV_READS` counts the key/value bytes every attention call here is handed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

ATTENTION_NAME = "domino_sdpa"


class KVReadCounter:
    """Bytes of keys and values handed to attention kernels, summed on the host from shapes (no
    device read). What a step reads is its span: the longest live row on the dynamic path, the
    whole capacity on the static one. Paged storage gathers those bytes once more before the
    kernel (model/kv/paged.py), which is not counted here. A replayed CUDA graph runs no Python:
    model/engine/static.py adds what its capture counted at each replay."""

    def __init__(self) -> None:
        self.bytes = 0

    def add(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.bytes += keys.numel() * keys.element_size() + values.numel() * values.element_size()


KV_READS = KVReadCounter()


def can_pack(num_heads: int, num_kv_heads: int, mask: torch.Tensor | None) -> bool:
    """Folding needs grouped heads and a mask shared by every head ([R, 1, T, K])."""
    return num_heads > num_kv_heads and mask is not None and mask.dim() == 4 and mask.shape[1] == 1


def packed_gqa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """SDPA of q [R, H, T, D] over k, v [R, KV, K, D] with a head-shared mask [R, 1, T, K].

    Query head h reads key/value head h // rep (transformers' `repeat_kv` order), so the heads of a
    group are consecutive: [R, H, T, D] is [R, KV, rep·T, D] as it lies in memory, and the mask
    repeats once per head of the group. Returns [R, H, T, D]."""
    r, h, t, d = q.shape
    kv = k.shape[1]
    rep = h // kv
    folded = q.reshape(r, kv, rep * t, d)
    folded_mask = mask.expand(r, rep, t, mask.shape[-1]).reshape(r, 1, rep * t, mask.shape[-1])
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=folded_mask, scale=scale)
    return out.view(r, h, t, d)


def _domino_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; output [R, T, H, D] like its SDPA. In a packed
    forward (`packed_cache` passed through the decoder's kwargs) each group attends on its own."""
    packed_cache = kwargs.get(PACKED_KWARG)
    if packed_cache is not None:
        return packed_attention(module, query, packed_cache, scaling), None
    KV_READS.add(key, value)
    q_len = query.shape[2]
    if q_len > 1 and dropout == 0.0 and can_pack(query.shape[1], key.shape[1], attention_mask):
        assert attention_mask is not None
        out = packed_gqa_attention(query, key, value, attention_mask[..., : key.shape[2]], scaling)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


def packed_attention(module: torch.nn.Module, query: torch.Tensor, cache: Any, scale: float | None) -> torch.Tensor:
    """Attention of a packed forward: query [1, H, N, D] holds several padded groups of rows one
    after another (`cache.packed`: model/kv/target_cache.py), each attending over its own rows' keys
    under its own mask, as a padded forward of that group alone would. Returns [1, N, H, D]."""
    _, h, _, d = query.shape
    outs = []
    for g in cache.packed:
        r = g.hi - g.lo
        q = query[0, :, g.offset : g.offset + r * g.width].view(h, r, g.width, d).transpose(0, 1)
        k, v = cache.view(module.layer_idx, g.lo, g.hi, g.kv_len)
        KV_READS.add(k, v)
        mask = g.mask[..., : k.shape[2]]
        if can_pack(h, k.shape[1], mask):
            out = packed_gqa_attention(q, k, v, mask, scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=h != k.shape[1])
        outs.append(out.transpose(1, 2).reshape(r * g.width, h, d))
    return torch.cat(outs)[None]


# The decoder keyword a packed forward passes its cache under (transformers hands a model's extra
# keywords down to the attention function).
PACKED_KWARG = "domino_packed_cache"

AttentionInterface.register(ATTENTION_NAME, _domino_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)


def use_packed_attention(hf_model: torch.nn.Module) -> None:
    """Switch a model loaded with SDPA attention to the folded version (other kernels are kept)."""
    if getattr(hf_model.config, "_attn_implementation", None) == "sdpa":
        hf_model.set_attn_implementation(ATTENTION_NAME)
