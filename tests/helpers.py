"""Tiny random models shared by the model tests (no hub access)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen3Config, Qwen3ForCausalLM

from model.nn.drafter import Drafter, DrafterConfig


def tiny_target(
    kind: str = "qwen3", vocab: int = 128, layers: int = 4, seed: int = 0, **config: Any
) -> PreTrainedModel:
    """A random tiny target. A wide init keeps logits far from ties, so greedy is well defined.
    `config` overrides fields of the model config (e.g. eos/pad ids for a served model)."""
    torch.manual_seed(seed)
    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        initializer_range=0.2,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    common.update(config)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        raise ValueError(kind)
    model.config._attn_implementation = "sdpa"
    return model.eval()


def tiny_drafter_config(
    domino: bool = True, vocab: int = 128, block_size: int = 6, taps: list[int] | None = None, **overrides: object
) -> DrafterConfig:
    fields: dict = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        vocab_size=vocab,
        block_size=block_size,
        target_layer_ids=taps or [1, 2],
        num_target_layers=4,
        mask_token_id=vocab - 1,
        rope_theta=10000.0,
        projector_type="domino" if domino else None,
        shift_label=domino,
        gru_hidden_dim=24,
        emb_dim=8,
    )
    fields.update(overrides)
    return DrafterConfig(**fields)


def tiny_drafter(domino: bool = True, seed: int = 1, std: float = 0.2, **kwargs: object) -> Drafter:
    torch.manual_seed(seed)
    drafter = Drafter(tiny_drafter_config(domino=domino, **kwargs))
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, std)
    return drafter.eval()
