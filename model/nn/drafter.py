"""Domino / DFlash drafter: a parallel block-drafting backbone plus an optional causal head.

Shapes: R = rows in the batch, B = block size, H = hidden size, T = new tokens per row,
L = key length, G = GRU size, V = draft vocabulary size (the full target vocabulary unless the
checkpoint restricts it with `draft_vocab_ids`).

The module is a little over 400 lines because the drafter, its context cache and its draft loop
share the shapes above and read best together.

The backbone has no embedding and no LM head: it borrows the target's (`bind_target`). Context
features of committed tokens are projected once into each layer's keys/values and cached per row
(`DraftContextCache`); a block `[anchor, MASK, ...]` attends non-causally to its row's context
and to itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model.engine.sampling import SamplingBatch, pick_tokens
from model.kv.draft_cache import DraftContextCache
from model.nn.attention import KV_READS, can_pack, packed_gqa_attention


@dataclass
class DrafterConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    target_layer_ids: list[int]
    num_target_layers: int
    mask_token_id: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    projector_type: str | None = None
    gru_hidden_dim: int = 1024
    emb_dim: int = 256
    pure_draft_prefix_len: int = 1
    shift_label: bool = False
    # Our extensions (absent from published checkpoints): a restricted draft vocabulary, stored as
    # the `draft_vocab_ids` tensor, and a learned mask embedding used instead of `mask_token_id`.
    draft_vocab_size: int | None = None
    use_mask_embedding: bool = False
    # Extension: `qk_norm: false` drops the per-head q/k RMSNorm (a drafter warm-started from a
    # target layer without one, e.g. Llama's, keeps that layer's attention intact).
    qk_norm: bool = True
    # Newer DFlash fields (absent from the published DFlash / Domino checkpoints, so the defaults
    # change nothing): a scalar on the block's input embeddings, and on the base logits a tanh soft
    # cap (None: off) then a multiplier, in the order vLLM's logits processor applies them.
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # Every other config.json field, kept so that save -> load round-trips.
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def has_head(self) -> bool:
        return self.projector_type == "domino"

    @property
    def num_drafts(self) -> int:
        """Drafts per block: B with shift_label (output j predicts position j + 1), else B - 1."""
        return self.block_size if self.shift_label else self.block_size - 1

    @property
    def first_draft_position(self) -> int:
        """The block position whose output drafts slot 0 (the anchor's, with shift_label)."""
        return 0 if self.shift_label else 1

    @property
    def draft_vocab(self) -> int:
        return self.draft_vocab_size or self.vocab_size


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Taps spread over the target's depth (docs/design.md §1.2)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    step = (num_target_layers - 4) / (num_draft_layers - 1)
    return [round(1 + i * step) for i in range(num_draft_layers)]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the Qwen3 reference so bf16 weights behave the same.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [..., head_dim] for integer `positions` [...]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [R, heads, T, hd]; cos/sin [R, T, hd]."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# Callback that turns a layer's block keys/values [R, kv, T, hd] into the full keys/values the
# block attends to, e.g. by writing them behind the cached context.
KVCombine = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class DraftAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values [R, kv, T, hd] for inputs x [R, T, H].

        Used for both context features and block hidden states: the same projections serve both.
        """
        r, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(r, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(r, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        combine: KVCombine,
        layer_idx: int,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        r, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(r, t, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k_block, v_block = self.keys_values(x, cos, sin)
        keys, values = combine(layer_idx, k_block, v_block)
        KV_READS.add(keys, values)
        if can_pack(self.num_heads, self.num_kv_heads, mask):
            out = packed_gqa_attention(q, keys, values, mask)
        else:
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads
            )
        return self.o_proj(out.transpose(1, 2).reshape(r, t, -1))


class DraftMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        combine: KVCombine,
        layer_idx: int,
        mask: torch.Tensor,
        num_outputs: int | None = None,
    ) -> torch.Tensor:
        """`num_outputs` keeps only the first positions after attention (every position's keys
        and values are still computed): the MLP is per position, so it runs only where needed."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, combine, layer_idx, mask)
        if num_outputs is not None:
            x = x[:, :num_outputs]
        return x + self.mlp(self.post_attention_layernorm(x))


def gru_cell(x: torch.Tensor, h: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor) -> torch.Tensor:
    """One bias-free GRU step (PyTorch gate order r, z, n) for x [R, H], h [R, G]."""
    gi = x @ w_ih.t()
    gh = h @ w_hh.t()
    i_r, i_z, i_n = gi.chunk(3, dim=-1)
    h_r, h_z, h_n = gh.chunk(3, dim=-1)
    r = torch.sigmoid(i_r + h_r)
    z = torch.sigmoid(i_z + h_z)
    n = torch.tanh(i_n + r * h_n)
    return (1 - z) * n + z * h


def new_context_cache(
    cfg: DrafterConfig,
    max_slots: int,
    capacity: int,
    dtype: torch.dtype,
    device: torch.device | str,
    paging: tuple[int, int] | None = None,
) -> DraftContextCache:
    """A drafter's context cache: `max_slots` rows of `capacity` context tokens for every layer in
    pools of blocks (model/kv/paged.py), with the scheduler's `paging` (num_blocks, block_size) or a
    fixed run of blocks per slot (None)."""
    shape = (cfg.num_hidden_layers, max_slots, capacity, cfg.num_key_value_heads, cfg.head_dim, dtype, device)
    if paging is not None:
        return DraftContextCache(*shape, *paging)
    return DraftContextCache.contiguous(*shape)


@dataclass
class DraftResult:
    tokens: torch.Tensor  # [R, D] full-vocabulary ids of the drafts
    token_probs: torch.Tensor  # [R, D] drafter probability of each chosen draft
    draft_probs: torch.Tensor | None  # [R, D, V] drafter distribution per slot (sampling rows only)
    confidence: torch.Tensor  # [R, D] largest probability of each slot's distribution (pre-draw)
    logits: torch.Tensor | None = None  # [R, D, V] final draft logits (return_logits=True)

    def select(self, a: int, b: int, d: int) -> DraftResult:
        """Rows a..b-1 and the first d slots."""

        def cut(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x[a:b, :d]

        return DraftResult(
            self.tokens[a:b, :d],
            self.token_probs[a:b, :d],
            cut(self.draft_probs),
            self.confidence[a:b, :d],
            cut(self.logits),
        )


class Drafter(nn.Module):
    """DFlash backbone (`fc`, `hidden_norm`, `layers`, `norm`) and the Domino head
    (`prefix_gru`, `embed_proj`), with the published parameter names."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        if cfg.has_head:
            self.prefix_gru = nn.GRU(h, cfg.gru_hidden_dim, num_layers=1, bias=False, batch_first=True)
            self.embed_proj = nn.Sequential(
                nn.Linear(h + cfg.gru_hidden_dim, cfg.emb_dim, bias=False),
                nn.SiLU(),
                nn.Linear(cfg.emb_dim, cfg.draft_vocab, bias=False),
            )
        if cfg.use_mask_embedding:
            self.mask_embedding = nn.Parameter(torch.zeros(h))
        if cfg.draft_vocab_size is not None:
            self.register_buffer("draft_vocab_ids", torch.arange(cfg.draft_vocab_size), persistent=True)
        self.use_head = cfg.has_head
        # The target's frozen embedding and LM head; see bind_target.
        self._embed_weight: torch.Tensor | None = None
        self._lm_head_weight: torch.Tensor | None = None
        # Packed weights on a CPU (`pack`): the layer kind, and the LM head rows packed with it.
        self._packing: type[nn.Module] | None = None
        self._lm_head: nn.Module | None = None

    # -- target binding -------------------------------------------------------------------------
    def bind_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Borrow the target's token embedding [Vt, H] and LM head [Vt, H] (never trained here)."""
        self._embed_weight = embed_weight
        self.refresh_lm_head(lm_head_weight)

    def pack(self, kind: type[nn.Module]) -> int:
        """Pack every linear layer, and the LM head rows once bound, as `kind` (model/nn/packed.py:
        a CPU target in int4 drafts with int4 too). Drafts only get cheaper or worse; what is
        committed is still the target's choice. The count of layers packed."""
        from model.nn.packed import pack_linears

        count = pack_linears(self, kind)
        self._packing = kind
        if self._lm_head_weight is not None:
            self._pack_lm_head()
        return count

    def _pack_lm_head(self) -> None:
        assert self._packing is not None and self._lm_head_weight is not None
        rows = self._lm_head_weight
        head = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device="meta")
        head.weight = nn.Parameter(rows.detach(), requires_grad=False)
        fits = getattr(self._packing, "fits", lambda _: True)
        self._lm_head = self._packing(head) if fits(head) else None

    def refresh_lm_head(self, lm_head_weight: torch.Tensor) -> None:
        self._refresh_lm_head(lm_head_weight)
        if self._packing is not None:
            self._pack_lm_head()

    def _refresh_lm_head(self, lm_head_weight: torch.Tensor) -> None:
        if self.config.draft_vocab_size is None:
            self._lm_head_weight = lm_head_weight  # borrowed, like the embedding
            return
        # A restricted draft vocabulary keeps only those LM-head rows: verification still uses the
        # full vocabulary, so this only changes what can be proposed.
        rows = lm_head_weight[self.draft_vocab_ids.to(lm_head_weight.device)]
        old = self._lm_head_weight
        if old is not None and (old.shape, old.dtype, old.device) == (rows.shape, rows.dtype, rows.device):
            # In place: every engine built over this drafter binds it again, and the CUDA graphs an
            # earlier engine captured read this tensor's memory; a new one would free it under them.
            with torch.inference_mode() if old.is_inference() else torch.no_grad():
                old.copy_(rows)
        else:
            self._lm_head_weight = rows

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        assert self._embed_weight is not None, "call bind_target() first"
        return F.embedding(token_ids, self._embed_weight)

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self._lm_head_weight is not None, "call bind_target() first"
        logits = self._lm_head(hidden) if self._lm_head is not None else hidden @ self._lm_head_weight.t()
        # Python-side checks: the default config adds no ops (and CUDA graphs see a fixed graph).
        # The Domino correction is added on top of these base logits, as in training.
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        return logits

    def to_full_vocab(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.config.draft_vocab_size is None:
            return draft_ids
        return self.draft_vocab_ids[draft_ids]

    # -- backbone -----------------------------------------------------------------------------
    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """Concatenated target taps [R, T, K*H] -> context hidden [R, T, H]."""
        return self.hidden_norm(self.fc(features))

    def context_keys_values(
        self, context: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context keys/values [R, kv, T, hd] for context hidden [R, T, H]."""
        cfg = self.config
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, context.dtype)
        return [layer.self_attn.keys_values(context, cos, sin) for layer in self.layers]

    def block_input(self, block_tokens: torch.Tensor) -> torch.Tensor:
        """Embeddings of `[anchor, MASK, ...]` blocks [R, B] -> [R, B, H]."""
        cfg = self.config
        if cfg.use_mask_embedding:
            x = self.embed(block_tokens[:, :1])
            masks = self.mask_embedding.to(x.dtype).expand(x.shape[0], block_tokens.shape[1] - 1, -1)
            x = torch.cat([x, masks], dim=1)
        else:
            x = self.embed(block_tokens)
        # The scale multiplies the whole block input (anchor and MASK rows alike); the Domino GRU
        # reads plain target embeddings.
        if cfg.input_embedding_scale != 1.0:
            x = x * cfg.input_embedding_scale
        return x

    def run_layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        combine: KVCombine,
        mask: torch.Tensor,
        num_outputs: int | None = None,
    ) -> torch.Tensor:
        """Hidden states [R, T, H] (the first `num_outputs` positions only, when given)."""
        cfg = self.config
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, x.dtype)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, combine, i, mask, num_outputs if i == last else None)
        return self.norm(x)

    # -- inference ----------------------------------------------------------------------------
    def append_context(
        self, cache: DraftContextCache, lo: int, features: torch.Tensor, counts: torch.Tensor, host_counts: list[int]
    ) -> None:
        """Append newly committed tokens' features [R, T, K*H] (counts[r] <= T valid; `host_counts`
        the same on the host) to slots lo..lo+R-1 at each row's current length."""
        self.write_context(cache, lo, features)
        cache.advance(lo, counts, host_counts)

    def write_context(self, cache: DraftContextCache, lo: int, features: torch.Tensor) -> None:
        """The context keys and values of features [R, T, K*H] written at slots lo..lo+R-1's next T
        positions, the rows' lengths unchanged: fixed shapes, nothing read back (a static verify
        runs it inside its captured function, before acceptance says how many count)."""
        r, t, _ = features.shape
        start = cache.starts(lo, r)
        positions = start[:, None] + torch.arange(t, device=features.device)[None, :]
        context = self.project_context(features)
        index = cache.scatter_index(lo, start, t)
        for i, (k, v) in enumerate(self.context_keys_values(context, positions)):
            cache.write(i, index, k, v)

    def forward_block(
        self,
        cache: DraftContextCache,
        lo: int,
        block_tokens: torch.Tensor,
        span: int | None = None,
        num_outputs: int | None = None,
    ) -> torch.Tensor:
        """Run blocks [R, B] for slots lo..lo+R-1, each placed right after its row's context.

        Returns final-normed hidden states [R, B, H] (or of the first `num_outputs` block
        positions: the rest only feed attention, and a step that drafts fewer slots than the
        block holds need not finish them). Attention is non-causal over
        [that row's context ; its block]. `span` attends over that many positions (fixed shapes,
        no read of the lengths back to the host: for CUDA graphs).
        """
        r, b = block_tokens.shape
        dev = block_tokens.device
        start = cache.starts(lo, r)
        positions = start[:, None] + torch.arange(b, device=dev)[None, :]
        kv_len = cache.attended(lo, r, b, span)
        # Key j of row r is visible iff it is part of that row's context or its block.
        visible = torch.arange(kv_len, device=dev)[None, :] < (start[:, None] + b)
        mask = visible[:, None, None, :]
        index = cache.scatter_index(lo, start, b)

        def combine(layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            cache.write(layer, index, k, v)
            return cache.view(layer, lo, lo + r, kv_len)

        return self.run_layers(self.block_input(block_tokens), positions, combine, mask, num_outputs)

    def correction(self, hidden: torch.Tensor, gru_state: torch.Tensor) -> torch.Tensor:
        """Low-rank logit correction W2 · SiLU(W1 · [H ; h]); shared by training and inference."""
        return self.embed_proj(torch.cat([hidden, gru_state.to(hidden.dtype)], dim=-1))

    def draft(
        self,
        hidden: torch.Tensor,
        anchors: torch.Tensor,
        sampling: SamplingBatch,
        return_logits: bool = False,
        num_slots: int | None = None,
        use_head: bool | None = None,
        dists_out: torch.Tensor | None = None,
    ) -> DraftResult:
        """Choose the drafts of one block per row from block hidden states [R, B, H]; only the
        first `num_slots` draft slots (default: all) are computed. `dists_out` [R, D, V]: where the
        sampling rows' distributions go (a buffer the static buckets share), else a new tensor.

        Without the head (or with `use_head` off) every slot picks from its base logits at once;
        with it, slots >= pure_draft_prefix_len add the GRU-conditioned correction, one slot at a
        time, vectorised across rows.
        """
        cfg = self.config
        draft_hidden = hidden[:, cfg.first_draft_position :]  # [R, D, H]
        if num_slots is not None:
            draft_hidden = draft_hidden[:, :num_slots]
        base = self.base_logits(draft_hidden)  # [R, D, V]
        use_head = self.use_head if use_head is None else use_head
        if not (use_head and cfg.has_head):
            ids, probs, dist, conf = pick_tokens(base, sampling)
            if dist is not None and dists_out is not None:
                dist = dists_out.copy_(dist)
            return DraftResult(self.to_full_vocab(ids), probs, dist, conf, base if return_logits else None)

        r, d, _ = base.shape
        w_ih, w_hh = self.prefix_gru.weight_ih_l0, self.prefix_gru.weight_hh_l0
        h = torch.zeros(r, cfg.gru_hidden_dim, dtype=w_hh.dtype, device=hidden.device)
        h = gru_cell(self.embed(anchors).to(w_ih.dtype), h, w_ih, w_hh)
        ids_out, probs_out, dists, confs, logits_out = [], [], [], [], []
        for i in range(d):
            logits = base[:, i]
            if i >= cfg.pure_draft_prefix_len:
                logits = logits + self.correction(draft_hidden[:, i], h)
            if return_logits:
                logits_out.append(logits)
            ids, probs, dist, conf = pick_tokens(logits, sampling, slot=i)
            confs.append(conf)
            full_ids = self.to_full_vocab(ids)
            ids_out.append(full_ids)
            probs_out.append(probs)
            dists.append(dist)
            if i + 1 < d:
                h = gru_cell(self.embed(full_ids).to(w_ih.dtype), h, w_ih, w_hh)
        draft_probs = None
        if dists[0] is not None:
            draft_probs = torch.stack(dists, dim=1) if dists_out is None else torch.stack(dists, dim=1, out=dists_out)
        return DraftResult(
            torch.stack(ids_out, dim=1),
            torch.stack(probs_out, dim=1),
            draft_probs,
            torch.stack(confs, dim=1),
            torch.stack(logits_out, dim=1) if return_logits else None,
        )


def head_parameters(drafter: Drafter) -> list[nn.Parameter]:
    """The Domino head's parameters (GRU and low-rank correction); none for a DFlash drafter."""
    if not drafter.config.has_head:
        return []
    return [*drafter.prefix_gru.parameters(), *drafter.embed_proj.parameters()]


def count_parameters(drafter: Drafter) -> dict[str, int]:
    """Parameter counts of the backbone and the head (target embedding/LM head excluded)."""
    head = sum(p.numel() for p in head_parameters(drafter))
    total = sum(p.numel() for p in drafter.parameters())
    return {"backbone": total - head, "head": head, "total": total}
