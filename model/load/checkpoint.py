"""Drafter checkpoints: `config.json` + `model.safetensors` in the published DFlash / Domino layouts.

Published layouts (docs/design.md §2): plain DFlash (`shift_label` absent or false, B - 1 drafts) and
Domino (`projector_type: "domino"`, `shift_label: true`, B drafts; a Domino head with `shift_label`
false drafts B - 1 like DFlash). Keys have no prefix, but a `model.` prefix is accepted, and so is
the legacy `logit_head.` container around the Domino head; `block_size` may sit at the top level or
in `dflash_config`. Weights may be one file or Hugging Face shards (`model.safetensors.index.json`).

Every config field is read, checked or known to be harmless: a value the drafter cannot honour is a
CheckpointError naming the field, and fields nobody knows are logged in one warning.

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
import logging
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from model.nn.drafter import Drafter, DrafterConfig

ARCHITECTURES = ("DFlashDraftModel", "DominoDraftModel")
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

log = logging.getLogger(__name__)

# The Qwen3 fields a saved config carries at the top level (config_to_dict).
_TOP_LEVEL_FIELDS = (
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
)
# Fields config_from_dict reads or checks (at the top level or in `dflash_config`).
_KNOWN_FIELDS = frozenset(
    {
        *_TOP_LEVEL_FIELDS,
        "architectures",
        "dflash_config",
        "block_size",
        "target_layer_ids",
        "mask_token_id",
        "rope_parameters",
        "rope_scaling",
        "hidden_act",
        "projector_type",
        "gru_hidden_dim",
        "emb_dim",
        "pure_draft_prefix_len",
        "shift_label",
        "draft_vocab_size",
        "use_mask_embedding",
        "qk_norm",
        "layer_types",
        "sliding_window",
        "use_sliding_window",
        "max_window_layers",
        "is_causal",
        "input_embedding_scale",
        "output_multiplier",
        "final_logit_softcapping",
    }
)
# Hugging Face config bookkeeping that changes nothing in the drafter's forward: dtype and version
# tags, token ids (the target's tokenizer decides those), training-only settings, remote-code hooks
# (never run here), and SGLang's `mask_token` string (only used when `mask_token_id` is absent,
# which is refused anyway).
_HARMLESS_FIELDS = frozenset(
    {
        "torch_dtype",
        "dtype",
        "transformers_version",
        "model_type",
        "_name_or_path",
        "name_or_path",
        "auto_map",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "tie_word_embeddings",
        "attention_dropout",
        "initializer_range",
        "use_cache",
        "mask_token",
    }
)
# Early Domino checkpoints nest the head under `logit_head.` (`logit_head.prefix_gru.*`,
# `logit_head.embed_proj.*`): the same tensors in another container, so only the prefix goes.
_LEGACY_HEAD_PREFIX = "logit_head."
_HEAD_MODULES = ("prefix_gru.", "embed_proj.")


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


def _positive_scalar(raw: dict[str, Any], name: str) -> float:
    """A multiplier field: absent or null means 1.0 (no change)."""
    value = _lookup(raw, name)
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise CheckpointError(
            f"drafter config.json: field '{name}' is {value!r}; it loads with a finite number > 0 "
            "(1.0 or absent: no scaling)"
        )
    return float(value)


def _softcap(raw: dict[str, Any]) -> float | None:
    value = _lookup(raw, "final_logit_softcapping")
    # 0 means off too (vLLM reads it that way).
    if value is None or (not isinstance(value, bool) and value == 0):
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise CheckpointError(
            f"drafter config.json: field 'final_logit_softcapping' is {value!r}; it loads with null (no cap) "
            "or a finite number > 0"
        )
    return float(value)


def _check_attention_layout(raw: dict[str, Any], num_layers: int) -> None:
    """The draft layers all use full attention, non-causal over the block (DFlash's training mask,
    which the engine, training and evaluation all build): refuse any other layout."""
    layer_types = _lookup(raw, "layer_types")
    window = _lookup(raw, "sliding_window")
    if layer_types is not None:
        if not isinstance(layer_types, list) or any(t != "full_attention" for t in layer_types):
            raise CheckpointError(
                f"drafter config.json: field 'layer_types' is {layer_types!r} (sliding_window {window!r}); "
                "only 'full_attention' draft layers are implemented: it loads when every entry is "
                "'full_attention' (or the field is absent)"
            )
    elif _lookup(raw, "use_sliding_window") and window is not None:
        # Hugging Face's Qwen3 rule when `layer_types` is absent: layers from `max_window_layers` on slide.
        first = int(_lookup(raw, "max_window_layers", 28))
        if first < num_layers:
            raise CheckpointError(
                f"drafter config.json: field 'use_sliding_window' is true (sliding_window {window}, "
                f"max_window_layers {first}), so draft layers {first}..{num_layers - 1} would use sliding-window "
                "attention, which is not implemented: it loads with use_sliding_window false or "
                f"max_window_layers >= {num_layers}"
            )
    is_causal = _lookup(raw, "is_causal")
    if is_causal not in (None, False):
        raise CheckpointError(
            f"drafter config.json: field 'is_causal' is {is_causal!r}; the draft block attends bidirectionally "
            "(DFlash's non-causal block): it loads with is_causal false or absent"
        )


def _check_fixed_fields(raw: dict[str, Any]) -> None:
    """Fields with one value the drafter computes with; a rope change only costs acceptance
    (verification keeps the output exact), so that one is a warning."""
    act = _lookup(raw, "hidden_act")
    if act not in (None, "silu"):
        raise CheckpointError(
            f"drafter config.json: field 'hidden_act' is {act!r}; the draft MLP is SwiGLU: it loads with 'silu'"
        )
    scaling = _lookup(raw, "rope_scaling")
    params = raw.get("rope_parameters")
    # A rope_scaling must say it is the default; rope_parameters (transformers 5) is by default.
    scaled = bool(scaling) and not (
        isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "default"
    )
    reparametrised = params is not None and not (
        isinstance(params, dict) and params.get("rope_type", "default") == "default"
    )
    if scaled or reparametrised:
        log.warning(
            "drafter config.json: rope_scaling %r / rope_parameters %r ignored; the drafter uses plain RoPE "
            "(theta only), so drafts may be accepted less often",
            scaling,
            raw.get("rope_parameters"),
        )


def _warn_unknown_fields(raw: dict[str, Any]) -> None:
    nested = raw.get("dflash_config") or {}
    known = _KNOWN_FIELDS | _HARMLESS_FIELDS
    unknown = sorted(k for k in raw if k not in known) + sorted(f"dflash_config.{k}" for k in nested if k not in known)
    if unknown:
        log.warning("drafter config.json: ignoring fields the drafter does not know: %s", ", ".join(unknown))


def config_from_dict(raw: dict[str, Any]) -> DrafterConfig:
    if not isinstance(raw.get("dflash_config") or {}, dict):
        raise CheckpointError("drafter config.json: field 'dflash_config' must be a JSON object")
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
        input_embedding_scale=_positive_scalar(raw, "input_embedding_scale"),
        output_multiplier=_positive_scalar(raw, "output_multiplier"),
        final_logit_softcapping=_softcap(raw),
        raw=copy.deepcopy(raw),
    )
    _check_attention_layout(raw, cfg.num_hidden_layers)
    _check_fixed_fields(raw)
    _warn_unknown_fields(raw)
    if cfg.block_size < 2:
        raise CheckpointError(f"drafter config.json: field 'block_size' must be >= 2, got {cfg.block_size}")
    if cfg.projector_type not in (None, "domino"):
        raise CheckpointError(
            f"drafter config.json: field 'projector_type' is {cfg.projector_type!r}, expected 'domino' or absent"
        )
    # A Domino head without shift_label is fine: Drafter.draft then reads outputs 1..B-1 (B - 1
    # drafts, the anchor's output unused) and the GRU still starts from the anchor, as SGLang does.
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
    for name in _TOP_LEVEL_FIELDS:
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
    neutral_values = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}
    for name, neutral in neutral_values.items():
        value = getattr(cfg, name)
        if name in raw and name not in dflash:
            raw[name] = value  # keep a field where the loaded file had it
        elif value != neutral or name in dflash:
            dflash[name] = value
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


def _read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"drafter checkpoint {file}: unreadable safetensors file ({exc})") from None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"drafter checkpoint {path}: invalid JSON ({exc})") from None


def _read_weights(path: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """Every tensor of a checkpoint, and the file that lists them: `model.safetensors`, or the
    index of a sharded checkpoint (`weight_map`: key -> shard file, as Hugging Face writes them)."""
    single, index = path / WEIGHTS_NAME, path / INDEX_NAME
    if single.is_file():
        return _read_safetensors(single), single
    if not index.is_file():
        raise CheckpointError(f"drafter checkpoint {path}: {WEIGHTS_NAME} not found (nor {INDEX_NAME})")
    data = _read_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(f, str) for f in weight_map.values()):
        raise CheckpointError(f"drafter checkpoint {index}: field 'weight_map' must map each key to a shard file")
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        if not (path / shard).is_file():
            raise CheckpointError(f"drafter checkpoint {path}: shard {shard} named in {INDEX_NAME} not found")
        tensors = _read_safetensors(path / shard)
        twice = sorted(set(state) & set(tensors))
        if twice:
            raise CheckpointError(f"drafter checkpoint {path}: keys {twice[:8]} are in more than one shard")
        state.update(tensors)
    absent = sorted(k for k in weight_map if k not in state)
    if absent:
        raise CheckpointError(
            f"drafter checkpoint {index}: keys {absent[:8]} are not in their shards (first: {weight_map[absent[0]]})"
        )
    return state, index


def _canonical_keys(state: dict[str, torch.Tensor], source: Path) -> dict[str, torch.Tensor]:
    """Published key names: drop an optional `model.` prefix and the legacy `logit_head.` container."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        name = key.removeprefix("model.")
        if name.startswith(_LEGACY_HEAD_PREFIX) and name.removeprefix(_LEGACY_HEAD_PREFIX).startswith(_HEAD_MODULES):
            name = name.removeprefix(_LEGACY_HEAD_PREFIX)
        if name in out:
            raise CheckpointError(f"drafter checkpoint {source}: '{name}' is stored twice (one copy as '{key}')")
        out[name] = tensor
    return out


def load_drafter(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    target_config: Any | None = None,
) -> Drafter:
    """Load a drafter directory; validate it against `target_config` (an HF config) when given."""
    path = Path(path)
    cfg_path = path / CONFIG_NAME
    if not cfg_path.is_file():
        raise CheckpointError(f"drafter checkpoint {path}: {CONFIG_NAME} not found")
    raw = _read_json(cfg_path)
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
    state, weights_path = _read_weights(path)
    state = _canonical_keys(state, weights_path)

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
