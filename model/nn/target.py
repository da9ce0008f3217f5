"""The target model: any Hugging Face causal LM, run over ragged rows with a preallocated KV cache.

Rows of a batch occupy consecutive slots `lo .. lo + R - 1` of the cache. Each forward writes row
r's T new keys/values at that row's own offset, attends through an explicit 4D mask, and returns
logits plus the hidden states of the tapped layers (the drafter's context features). Rolling back
rejected tokens is free: a row's length simply isn't advanced past them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from model.kv.target_cache import PackedGroup, RaggedKVCache, check_cache_written
from model.nn.attention import PACKED_KWARG, use_packed_attention
from model.nn.lean import LeanDecoder, lean_unsupported


def cache_argument(forward: Callable[..., Any]) -> str:
    """The keyword a decoder's forward takes its cache under: `cache` (newer transformers) or
    `past_key_values` (older ones, e.g. the GPU image's 5.17). Passing the wrong one is silent: the
    decoder swallows it into **kwargs and builds a cache of its own, so ours is never written."""
    params = inspect.signature(forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise TypeError(f"{getattr(forward, '__qualname__', forward)} takes neither `cache` nor `past_key_values`")


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [R, T, V] (or [R, 1, V] when only the last position was asked for)
    features: torch.Tensor | None  # [R, T, K*H] concatenated taps, when taps are set
    hidden: torch.Tensor | None = None  # [R, T, H] final hidden states, with keep_hidden (prompt logprobs)
    # The drafter's context keys and values of these T positions are written already (a static
    # verify writes them in its captured function): accepting them only moves the lengths.
    drafter_context: bool = False


@dataclass
class RowGroup:
    """The rows of one group of a packed forward (`TargetModel.forward_packed`): slots
    lo..lo+R-1, tokens [R, T] padded on the right, and (prefill) the one position per row whose
    logits are wanted."""

    lo: int
    tokens: torch.Tensor
    logits_at: torch.Tensor | None = None


class TargetModel:
    """Wraps an HF causal LM: ragged forwards over a RaggedKVCache, with hidden-state taps."""

    def __init__(self, hf_model: nn.Module, tap_layer_ids: list[int] | None = None, lean: bool = True) -> None:
        """`lean`: run Llama-family decoders through model/nn/lean.py (the same arithmetic, less
        machinery); other architectures, or `lean=False`, through transformers' own forward."""
        self.hf_model = hf_model.eval()
        use_packed_attention(hf_model)  # grouped heads without copying the cache (model/nn/attention.py)
        self.config = hf_model.config
        self.decoder = hf_model.get_decoder() if hasattr(hf_model, "get_decoder") else hf_model.model
        self.lm_head = hf_model.get_output_embeddings()
        self.embed_tokens = hf_model.get_input_embeddings()
        self.cache_kwarg = cache_argument(self.decoder.forward)  # inspected once, not per forward
        self.num_layers = int(self.config.num_hidden_layers)
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(self.lm_head.weight.shape[0])
        self.dtype = next(hf_model.parameters()).dtype
        self.device = next(hf_model.parameters()).device
        self.kv_heads = int(getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads)
        self.head_dim = int(
            getattr(self.config, "head_dim", None) or self.hidden_size // self.config.num_attention_heads
        )
        self.lean = LeanDecoder(self.decoder) if lean and lean_unsupported(self.config) is None else None
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks: list[Any] = []
        self.tap_layer_ids: list[int] = []
        self.set_taps(tap_layer_ids or [])

    def packed_layers(self) -> dict[str, int]:
        """Linear layers on packed weights (model/nn/packed.py) by kind ('int4', 'int8'): count."""
        from model.nn.packed import PackedLinear

        packed: dict[str, int] = {}
        for module in self.hf_model.modules():
            if isinstance(module, PackedLinear):
                name = type(module).__name__.removesuffix("Linear").lower()
                packed[name] = packed.get(name, 0) + 1
        return packed

    def summary(self) -> str:
        """What runs a forward, for the start-up log: the weights' format and the decoder's path."""
        packed = self.packed_layers()
        dtype = str(self.dtype).removeprefix("torch.")
        if packed:
            kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(packed.items()))
            weights = f"packed linear layers ({kinds}), {dtype} activations"
        else:
            weights = f"{dtype} weights"
        reason = lean_unsupported(self.config)
        if self.lean is not None:
            path = "lean Llama-family forward (model/nn/lean.py)"
        else:
            path = f"transformers' forward ({reason or 'lean forward turned off'})"
        return f"target: {weights}; {path}"

    def set_taps(self, tap_layer_ids: list[int]) -> None:
        """Capture the outputs of these decoder layers (HF `hidden_states[l + 1]`)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.tap_layer_ids = list(tap_layer_ids)
        layers = self.decoder.layers
        for layer_id in self.tap_layer_ids:

            def hook(_module: nn.Module, _inputs: Any, output: Any, layer_id: int = layer_id) -> None:
                self._captured[layer_id] = output[0] if isinstance(output, tuple) else output

            self._hooks.append(layers[layer_id].register_forward_hook(hook))

    def add_taps(self, tap_layer_ids: list[int]) -> None:
        """Also capture these layers, keeping the others: engines sharing one target (benchmarks
        build several) each ask `forward` for their own taps."""
        wanted = sorted(set(self.tap_layer_ids) | set(tap_layer_ids))
        if wanted != sorted(self.tap_layer_ids):
            self.set_taps(wanted)

    def new_cache(self, max_slots: int, capacity: int, paging: tuple[int, int] | None = None) -> RaggedKVCache:
        """A cache of `max_slots` rows of `capacity` tokens in pools of blocks (model/kv/paged.py):
        `paging` (num_blocks, block_size) for the scheduler's tables, or None for a fixed run of
        blocks per slot (benchmarks and tests that set lengths directly)."""
        shape = (self.num_layers, max_slots, capacity, self.kv_heads, self.head_dim, self.dtype, self.device)
        if paging is not None:
            return RaggedKVCache(*shape, *paging)
        return RaggedKVCache.contiguous(*shape)

    @torch.inference_mode()
    def forward(
        self,
        cache: RaggedKVCache,
        lo: int,
        tokens: torch.Tensor,
        logits_at: torch.Tensor | None = None,
        want_features: bool = True,
        span: int | None = None,
        taps: list[int] | None = None,
        keep_hidden: bool = False,
    ) -> TargetOutput:
        """Run tokens [R, T] for slots lo..lo+R-1, placed at each row's current cache length.

        Rows with fewer real tokens pad on the right; padded positions are written past the
        row's length and never counted. `logits_at` [R] picks one position per row for the LM
        head (prefill); otherwise logits for all T positions are returned. `taps` picks the tapped
        layers concatenated into the features (default: all of them). `span` attends over that
        many positions (a static-shape bucket's context): shapes depend only on [R, T] and the span,
        and nothing is read back to the host (model/engine/static.py captures this in CUDA graphs).
        `keep_hidden` also returns every position's final hidden state, for the caller to apply the
        LM head in chunks (prompt logprobs).
        """
        r, t = tokens.shape
        start = cache.starts(lo, r)
        positions = start[:, None] + torch.arange(t, device=tokens.device)[None, :]
        cache.prepare(lo, start, t, span=span)
        mask = self._causal_mask(positions, cache.get_seq_length())
        taps = self.tap_layer_ids if taps is None else taps
        hidden, captured = self._decode(cache, tokens, positions, mask, taps if want_features else [], {})
        all_hidden = hidden
        if logits_at is not None:
            hidden = hidden[torch.arange(r, device=hidden.device), logits_at][:, None]
        logits = self.lm_head(hidden)
        features = None
        if want_features and taps:
            features = torch.cat([captured[i] for i in taps], dim=-1)
        return TargetOutput(logits=logits, features=features, hidden=all_hidden if keep_hidden else None)

    def _decode(
        self,
        cache: RaggedKVCache,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        taps: list[int],
        extra: dict[str, Any],
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The decoder over `cache` (prepared): final hidden states and the tapped layers' outputs.
        A packed forward passes `extra` (its cache under PACKED_KWARG) and a placeholder mask."""
        if self.lean is not None:
            hidden, captured = self.lean(tokens, positions, None if extra else mask, cache, frozenset(taps))
        else:
            self._captured.clear()
            kwargs = {self.cache_kwarg: cache, **extra}
            out = self.decoder(
                input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=True, **kwargs
            )  # fmt: skip
            hidden, captured = out.last_hidden_state, dict(self._captured)
            self._captured.clear()
        check_cache_written(cache, self.num_layers)  # host-side only: no sync, fine inside a graph capture
        return hidden, captured

    def _causal_mask(self, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """[R, 1, T, kv_len]: each row's token at `positions` [R, T] sees its own committed prefix
        and the new tokens up to itself."""
        visible = torch.arange(kv_len, device=positions.device)[None, None, :] <= positions[:, :, None]
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=positions.device)
        return mask.masked_fill(~visible, torch.finfo(self.dtype).min)[:, None]

    @torch.inference_mode()
    def forward_packed(
        self, cache: RaggedKVCache, groups: list[RowGroup], want_features: bool = True, taps: list[int] | None = None
    ) -> list[TargetOutput]:
        """Several groups of rows in one decoder pass, each as `forward` would run it alone (a
        decode step's verify and a prompt chunk, say): the groups' tokens go through the weights as
        one sequence [1, N], so a step pays the weights' reads and the per-forward work once, while
        attention runs per group over its own rows (model/nn/attention.py: `packed_attention`)."""
        dev = groups[0].tokens.device
        packed: list[PackedGroup] = []
        starts, positions = [], []
        offset = 0
        for g in groups:
            r, t = g.tokens.shape
            start = cache.starts(g.lo, r)
            pos = start[:, None] + torch.arange(t, device=dev)[None, :]
            kv_len = cache.attended(g.lo, r, t)
            packed.append(PackedGroup(g.lo, g.lo + r, t, offset, kv_len, self._causal_mask(pos, kv_len)))
            starts.append(start)
            positions.append(pos.reshape(-1))
            offset += r * t
        cache.prepare_packed(packed, starts)
        tokens = torch.cat([g.tokens.reshape(-1) for g in groups])[None]
        # A 4D mask is taken as it is; each group's own masks are in `packed`.
        placeholder = torch.zeros(1, 1, 1, 1, dtype=self.dtype, device=dev)
        taps = self.tap_layer_ids if taps is None else taps
        try:
            hidden, captured = self._decode(
                cache, tokens, torch.cat(positions)[None], placeholder, taps if want_features else [],
                {PACKED_KWARG: cache},
            )  # fmt: skip
        finally:
            cache.packed = []
        hidden = hidden[0]
        tapped = torch.cat([captured[i][0] for i in taps], dim=-1) if want_features and taps else None
        outputs = []
        for g, p in zip(groups, packed):
            r, t = g.tokens.shape
            h = hidden[p.offset : p.offset + r * t].view(r, t, -1)
            if g.logits_at is not None:
                h = h[torch.arange(r, device=dev), g.logits_at][:, None]
            features = None if tapped is None else tapped[p.offset : p.offset + r * t].view(r, t, -1)
            outputs.append(TargetOutput(logits=self.lm_head(h), features=features))
        return outputs
