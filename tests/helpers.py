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


def planted_records(
    device: str, variants: list[str], taus: list[float], batch: int, max_new_tokens: int, max_model_len: int
) -> list[dict[str, Any]]:
    """bench.gpu_check.planted end to end at 1/16 width: `ar` (tau 1) and the oracle Domino drafter at each
    tau, each engine variant built and run in turn on one planted target (the GPU check's e2e loop,
    over variants). Each record carries its batch, mode, variant and static warm-up."""
    from argparse import Namespace

    from bench import common
    from bench.gpu_check.planted import build_engine, build_planted, measure

    args = Namespace(scale=16, layers_scale=9, device=device, dtype="auto", threads=0, seed=0, embed_rms=32.0)
    target, drafter, planted, _ = build_planted(args)
    assert planted["greedy_is_copy"] == 1.0, planted
    prompts = torch.randint(0, target.vocab_size, (batch, 32), generator=torch.Generator().manual_seed(0)).tolist()
    records = []
    with torch.inference_mode():
        for mode in ("ar", "domino"):
            for variant in variants:
                engine = build_engine(target, drafter, mode, variant, batch, max_model_len)
                warmup = common.static_warmup(engine)
                for tau in [1.0] if mode == "ar" else taus:
                    rec = {"batch": batch, "mode": mode, "variant": variant, "warmup": warmup}
                    records.append(rec | measure(engine, prompts, tau, max_new_tokens, repeats=1))
                del engine
    return records


def assert_lengths_mirrored(engine: Any) -> None:
    """Each of the engine's caches holds the same lengths on the host as on the device, every slot."""
    for cache in (engine.cache, engine.draft_cache):
        if cache is not None:
            assert cache.host_lengths == cache.lengths.tolist(), (type(cache).__name__, cache.host_lengths)
