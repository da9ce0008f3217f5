"""A lean decoder forward for Llama-family targets (Llama, Qwen2, Qwen3, Mistral without windows).

The same arithmetic as transformers' decoder, op for op (its RMSNorm, rotary embedding, SiLU MLP,
residual adds, the model's own linear modules), over our cache and attention, without its
per-call machinery: keyword plumbing, the attention-function registry, mask construction,
output records and a module call per norm. On a CPU a one-token step of the embedded default
spends more time around its ops than in its matmuls once the weights are packed (issue 56,
docs/benchmarks.md), so this is where the step's time goes down; on a GPU it is the same work in
fewer Python frames. Architectures outside the family keep transformers' forward
(`lean_unsupported` says why).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model.kv.target_cache import RaggedKVCache
from model.nn.attention import KV_READS, can_pack, packed_attention, packed_gqa_attention

LEAN_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})


def lean_unsupported(config: object) -> str | None:
    """Why the lean forward cannot run this model (None: it can)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in LEAN_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {sorted(LEAN_MODEL_TYPES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r}"  # type: ignore[attr-defined]
    layer_types = getattr(config, "layer_types", None) or []
    if "sliding_attention" in layer_types or (model_type == "mistral" and getattr(config, "sliding_window", None)):
        return "sliding-window attention"
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama/Qwen RMSNorm, op for op (in float32, the weight applied after the cast
    back): its rounding in bf16 is what greedy identity with it needs."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [R, heads, T, D] with cos/sin [R, 1, T, D] (rotate-half layout)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@dataclass
class LeanLayer:
    """One decoder layer's parts, looked up once."""

    attn: nn.Module  # for `layer_idx` (packed attention reads the cache by it)
    in_norm: torch.Tensor
    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    o_proj: nn.Module
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module


class LeanDecoder:
    """`decoder(tokens, positions, mask, cache, taps)`: the final hidden states [R, T, H] and the
    outputs of the tapped layers (HF `hidden_states[l + 1]`)."""

    def __init__(self, decoder: nn.Module) -> None:
        config = decoder.config
        self.embed = decoder.embed_tokens
        self.rotary = decoder.rotary_emb
        self.norm = decoder.norm.weight
        self.eps = float(config.rms_norm_eps)
        self.heads = int(config.num_attention_heads)
        self.layers = [self._layer(layer) for layer in decoder.layers[: config.num_hidden_layers]]

    @staticmethod
    def _layer(layer: nn.Module) -> LeanLayer:
        attn, mlp = layer.self_attn, layer.mlp
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        return LeanLayer(
            attn=attn, in_norm=layer.input_layernorm.weight,
            q_proj=attn.q_proj, k_proj=attn.k_proj, v_proj=attn.v_proj, o_proj=attn.o_proj,
            q_norm=None if q_norm is None else q_norm.weight, k_norm=None if k_norm is None else k_norm.weight,
            post_norm=layer.post_attention_layernorm.weight,
            gate_proj=mlp.gate_proj, up_proj=mlp.up_proj, down_proj=mlp.down_proj,
        )  # fmt: skip

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        cache: RaggedKVCache,
        taps: frozenset[int],
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """tokens and positions [R, T]; `mask` [R, 1, T, K] additive (None in a packed forward:
        each group carries its own, `cache.packed`)."""
        h = self.embed(tokens)
        cos, sin = self.rotary(h, positions)
        cos, sin = cos[:, None], sin[:, None]
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            h = h + self._attention(layer, rms_norm(h, layer.in_norm, self.eps), cos, sin, mask, cache)
            x = rms_norm(h, layer.post_norm, self.eps)
            h = h + layer.down_proj(F.silu(layer.gate_proj(x)) * layer.up_proj(x))
            if i in taps:
                captured[i] = h
        return rms_norm(h, self.norm, self.eps), captured

    def _attention(
        self,
        layer: LeanLayer,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: RaggedKVCache,
    ) -> torch.Tensor:
        r, t, _ = x.shape
        attn = layer.attn
        q = layer.q_proj(x).view(r, t, self.heads, -1)
        k = layer.k_proj(x).view(r, t, -1, q.shape[-1])
        v = layer.v_proj(x).view(r, t, -1, q.shape[-1]).transpose(1, 2)
        if layer.q_norm is not None and layer.k_norm is not None:
            q, k = rms_norm(q, layer.q_norm, self.eps), rms_norm(k, layer.k_norm, self.eps)
        q = rotate(q.transpose(1, 2), cos, sin)
        k = rotate(k.transpose(1, 2), cos, sin)
        keys, values = cache.update(k, v, attn.layer_idx)
        if cache.packed:
            out = packed_attention(attn, q, cache, attn.scaling)  # [1, N, H, D]
        else:
            assert mask is not None
            KV_READS.add(keys, values)
            mask = mask[..., : keys.shape[2]]
            if can_pack(q.shape[1], keys.shape[1], mask):
                out = packed_gqa_attention(q, keys, values, mask, attn.scaling)
            else:
                gqa = q.shape[1] != keys.shape[1]
                out = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=mask, scale=attn.scaling, enable_gqa=gqa
                )  # fmt: skip
            out = out.transpose(1, 2)
        return layer.o_proj(out.reshape(r, t, -1))
