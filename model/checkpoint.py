"""Drafter checkpoints: `config.json` + `model.safetensors` in the published DFlash / Domino layouts.

Published layouts (docs/design.md §2): plain DFlash (`shift_label` absent or false, B - 1 drafts) and
Domino (`projector_type: "domino"`, `shift_label: true`, B drafts). Keys have no prefix, but a
`model.` prefix is accepted; `block_size` may sit at the top level or in `dflash_config`.

Our extensions, both optional and stored in the same two files:
- `draft_vocab_size` in `dflash_config` plus a `draft_vocab_ids` int64 tensor: the drafter only
  proposes those target tokens (its LM head is the target's, restricted to those rows).
- `use_mask_embedding: true` in `dflash_config` plus a `mask_embedding [H]` tensor: a learned
  embedding for the MASK slots, for targets whose vocabulary has no spare token to use as
  `mask_token_id` (then `mask_token_id` may be null).
- `qk_norm: false` in `dflash_config`: the draft layers have no per-head q/k RMSNorm (and no
  `q_norm`/`k_norm` tensors).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from model.drafter import Drafter, DrafterConfig

ARCHITECTURES = ("DFlashDraftModel", "DominoDraftModel")
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


class CheckpointError(ValueError):
    """A drafter checkpoint that cannot be used, with a message naming the field at fault."""


def _lookup(raw: dict[str, Any], name: str, default: Any = None) -> Any:
    """A field from `dflash_config` first, then the top level (both layouts exist)."""
    nested = raw.get("dflash_config") or {}
    if name in nested:
        return nested[name]
    return raw.get(name, default)


def _require(raw: dict[str, Any], name: str) -> Any:
    value = _lookup(raw, name)
    if value is None:
        raise CheckpointError(f"drafter config.json: required field '{name}' is missing")
    return value


def config_from_dict(raw: dict[str, Any]) -> DrafterConfig:
    archs = raw.get("architectures") or []
    if archs and not any(a in ARCHITECTURES for a in archs):
        raise CheckpointError(
            f"drafter config.json: field 'architectures' is {archs}, expected one of {list(ARCHITECTURES)}"
        )
    hidden = int(_require(raw, "hidden_size"))
    heads = int(_require(raw, "num_attention_heads"))
    rope_theta = _lookup(raw, "rope_theta")
    if rope_theta is None:
        rope_theta = (raw.get("rope_parameters") or {}).get("rope_theta", 1_000_000.0)
    taps = _require(raw, "target_layer_ids")
    if not isinstance(taps, list) or not taps or not all(isinstance(t, int) for t in taps):
        raise CheckpointError(
            f"drafter config.json: field 'target_layer_ids' must be a non-empty int list, got {taps!r}"
        )
    cfg = DrafterConfig(
        hidden_size=hidden,
        num_hidden_layers=int(_require(raw, "num_hidden_layers")),
        num_attention_heads=heads,
        num_key_value_heads=int(_lookup(raw, "num_key_value_heads", heads)),
        head_dim=int(_lookup(raw, "head_dim") or hidden // heads),
        intermediate_size=int(_require(raw, "intermediate_size")),
        vocab_size=int(_require(raw, "vocab_size")),
        block_size=int(_require(raw, "block_size")),
        target_layer_ids=list(taps),
        num_target_layers=int(_lookup(raw, "num_target_layers", max(taps) + 1)),
        mask_token_id=_lookup(raw, "mask_token_id"),
        rms_norm_eps=float(_lookup(raw, "rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=int(_lookup(raw, "max_position_embeddings", 40960)),
        attention_bias=bool(_lookup(raw, "attention_bias", False)),
        projector_type=_lookup(raw, "projector_type"),
        gru_hidden_dim=int(_lookup(raw, "gru_hidden_dim", 1024)),
        emb_dim=int(_lookup(raw, "emb_dim", 256)),
        pure_draft_prefix_len=int(_lookup(raw, "pure_draft_prefix_len", 1)),
        shift_label=bool(_lookup(raw, "shift_label", False)),
        draft_vocab_size=_lookup(raw, "draft_vocab_size"),
        use_mask_embedding=bool(_lookup(raw, "use_mask_embedding", False)),
        qk_norm=bool(_lookup(raw, "qk_norm", True)),
        raw=copy.deepcopy(raw),
    )
    if cfg.block_size < 2:
        raise CheckpointError(f"drafter config.json: field 'block_size' must be >= 2, got {cfg.block_size}")
    if cfg.projector_type not in (None, "domino"):
        raise CheckpointError(
            f"drafter config.json: field 'projector_type' is {cfg.projector_type!r}, expected 'domino' or absent"
        )
    if cfg.has_head and not cfg.shift_label:
        raise CheckpointError("drafter config.json: field 'shift_label' must be true when projector_type is 'domino'")
    if cfg.mask_token_id is None and not cfg.use_mask_embedding:
        raise CheckpointError(
            "drafter config.json: field 'mask_token_id' is missing and 'use_mask_embedding' is not set"
        )
    return cfg


def config_to_dict(cfg: DrafterConfig) -> dict[str, Any]:
    """The published layout: Qwen3 fields at the top level, drafter fields in `dflash_config`."""
    raw = copy.deepcopy(cfg.raw)
    raw.setdefault("architectures", ["DFlashDraftModel"])
    raw.setdefault("model_type", "qwen3")
    for name in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
        "rms_norm_eps",
        "rope_theta",
        "max_position_embeddings",
        "attention_bias",
        "num_target_layers",
    ):
        raw[name] = getattr(cfg, name)
    if "block_size" in raw or "block_size" not in (raw.get("dflash_config") or {}):
        raw["block_size"] = cfg.block_size
    dflash = raw.setdefault("dflash_config", {})
    dflash["mask_token_id"] = cfg.mask_token_id
    dflash["target_layer_ids"] = list(cfg.target_layer_ids)
    if "block_size" in dflash:
        dflash["block_size"] = cfg.block_size
    if cfg.has_head:
        dflash.update(
            projector_type="domino",
            gru_hidden_dim=cfg.gru_hidden_dim,
            emb_dim=cfg.emb_dim,
            pure_draft_prefix_len=cfg.pure_draft_prefix_len,
        )
    if cfg.shift_label or "shift_label" in dflash:
        dflash["shift_label"] = cfg.shift_label
    if cfg.draft_vocab_size is not None:
        dflash["draft_vocab_size"] = cfg.draft_vocab_size
    if cfg.use_mask_embedding:
        dflash["use_mask_embedding"] = True
    if not cfg.qk_norm:
        dflash["qk_norm"] = False
    return raw


def validate_against_target(cfg: DrafterConfig, hidden_size: int, vocab_size: int, num_layers: int) -> None:
    """Fail with a message naming the field and both values when the drafter can't serve the target."""
    if cfg.hidden_size != hidden_size:
        raise CheckpointError(
            f"drafter hidden_size {cfg.hidden_size} does not match the target's hidden_size {hidden_size}"
        )
    if cfg.vocab_size != vocab_size:
        raise CheckpointError(
            f"drafter vocab_size {cfg.vocab_size} does not match the target's vocab_size {vocab_size}"
        )
    bad = [t for t in cfg.target_layer_ids if not 0 <= t < num_layers]
    if bad:
        raise CheckpointError(
            f"drafter target_layer_ids {cfg.target_layer_ids} include {bad}, outside the target's "
            f"{num_layers} layers (num_hidden_layers {num_layers})"
        )
    if not cfg.use_mask_embedding and not 0 <= int(cfg.mask_token_id) < vocab_size:  # type: ignore[arg-type]
        raise CheckpointError(
            f"drafter mask_token_id {cfg.mask_token_id} is outside the target's vocabulary (vocab_size {vocab_size})"
        )


def load_drafter(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    target_config: Any | None = None,
) -> Drafter:
    """Load a drafter directory; validate it against `target_config` (an HF config) when given."""
    path = Path(path)
    cfg_path, weights_path = path / CONFIG_NAME, path / WEIGHTS_NAME
    if not cfg_path.is_file():
        raise CheckpointError(f"drafter checkpoint {path}: {CONFIG_NAME} not found")
    if not weights_path.is_file():
        raise CheckpointError(f"drafter checkpoint {path}: {WEIGHTS_NAME} not found")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"drafter checkpoint {cfg_path}: invalid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"drafter checkpoint {cfg_path}: expected a JSON object")
    cfg = config_from_dict(raw)
    if target_config is not None:
        validate_against_target(
            cfg,
            hidden_size=int(target_config.hidden_size),
            vocab_size=int(target_config.vocab_size),
            num_layers=int(target_config.num_hidden_layers),
        )
    try:
        state = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"drafter checkpoint {weights_path}: unreadable safetensors file ({exc})") from None
    state = {k.removeprefix("model."): v for k, v in state.items()}

    with torch.device("meta"):
        drafter = Drafter(cfg)
    expected = drafter.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise CheckpointError(f"drafter checkpoint {weights_path}: missing keys {missing[:8]}")
    if unexpected:
        raise CheckpointError(f"drafter checkpoint {weights_path}: unexpected keys {unexpected[:8]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"drafter checkpoint {weights_path}: '{name}' has shape {list(tensor.shape)}, "
                f"config implies {list(expected[name].shape)}"
            )
    converted = {
        k: v.to(device=device) if k == "draft_vocab_ids" else v.to(device=device, dtype=dtype) for k, v in state.items()
    }
    drafter.load_state_dict(converted, assign=True)
    if cfg.draft_vocab_size is not None:
        ids = drafter.draft_vocab_ids
        if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
            raise CheckpointError(f"drafter draft_vocab_ids fall outside the vocabulary (vocab_size {cfg.vocab_size})")
    return drafter.eval()


def save_drafter(drafter: Drafter, path: str | Path, dtype: torch.dtype | None = torch.bfloat16) -> None:
    """Write config.json + model.safetensors (weights cast to `dtype`; None keeps them)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, tensor in drafter.state_dict().items():
        tensor = tensor.detach().cpu()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        state[name] = tensor.contiguous()
    save_file(state, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
    # safetensors creates the file owner-only; checkpoints are meant to be shared (e.g. COPY'd into
    # an image that runs as another user).
    (path / WEIGHTS_NAME).chmod(0o644)
    (path / CONFIG_NAME).write_text(json.dumps(config_to_dict(drafter.config), indent=2, sort_keys=True) + "\n")
