"""Checkpoint I/O: the published DFlash and Domino layouts, round trips, and clear failures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.checkpoint import CheckpointError, load_drafter, save_drafter
from model.drafter import Drafter
from tests.helpers import tiny_drafter, tiny_target

H, KV, HEADS, HD, FF, V, G, R = 64, 2, 4, 16, 96, 128, 24, 8


def _published_tensors(domino: bool, layers: int = 2, taps: int = 2, prefix: str = "") -> dict[str, torch.Tensor]:
    """Random weights under the exact published key names (docs/design.md §2), in bf16 like the hub files."""
    g = torch.Generator().manual_seed(0)

    def t(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.1).to(torch.bfloat16)

    out = {"fc.weight": t(H, taps * H), "hidden_norm.weight": t(H), "norm.weight": t(H)}
    for i in range(layers):
        p = f"layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": t(HEADS * HD, H),
            p + "self_attn.k_proj.weight": t(KV * HD, H),
            p + "self_attn.v_proj.weight": t(KV * HD, H),
            p + "self_attn.o_proj.weight": t(H, HEADS * HD),
            p + "self_attn.q_norm.weight": t(HD),
            p + "self_attn.k_norm.weight": t(HD),
            p + "mlp.gate_proj.weight": t(FF, H),
            p + "mlp.up_proj.weight": t(FF, H),
            p + "mlp.down_proj.weight": t(H, FF),
            p + "input_layernorm.weight": t(H),
            p + "post_attention_layernorm.weight": t(H),
        }
    if domino:
        out |= {
            "prefix_gru.weight_ih_l0": t(3 * G, H),
            "prefix_gru.weight_hh_l0": t(3 * G, G),
            "embed_proj.0.weight": t(R, H + G),
            "embed_proj.2.weight": t(V, R),
        }
    return {prefix + k: v for k, v in out.items()}


def _published_config(domino: bool, block_in_dflash_config: bool = False, arch: str = "DFlashDraftModel") -> dict:
    cfg = {
        "architectures": [arch],
        "model_type": "qwen3",
        "hidden_size": H,
        "num_hidden_layers": 2,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "head_dim": HD,
        "intermediate_size": FF,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "vocab_size": V,
        "max_position_embeddings": 40960,
        "num_target_layers": 4,
        "torch_dtype": "bfloat16",
        "dflash_config": {"mask_token_id": V - 1, "target_layer_ids": [1, 2]},
    }
    if block_in_dflash_config:
        cfg["dflash_config"]["block_size"] = 6
    else:
        cfg["block_size"] = 6
    if domino:
        cfg["dflash_config"] |= {
            "projector_type": "domino",
            "gru_hidden_dim": G,
            "emb_dim": R,
            "pure_draft_prefix_len": 1,
            "shift_label": True,
        }
    return cfg


def _write(path: Path, cfg: dict, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize(
    ("domino", "prefix", "block_nested", "arch"),
    [
        (False, "", False, "DFlashDraftModel"),
        (True, "", False, "DFlashDraftModel"),
        (True, "model.", True, "DominoDraftModel"),
        (False, "model.", True, "DFlashDraftModel"),
    ],
)
def test_published_layouts_load(tmp_path: Path, domino: bool, prefix: str, block_nested: bool, arch: str) -> None:
    tensors = _published_tensors(domino, prefix=prefix)
    ckpt = _write(tmp_path / "ckpt", _published_config(domino, block_nested, arch), tensors)
    target = tiny_target()
    drafter = load_drafter(ckpt, dtype=torch.float32, target_config=target.config)
    cfg = drafter.config
    assert cfg.block_size == 6
    assert cfg.has_head == domino and cfg.shift_label == domino
    assert cfg.num_drafts == (6 if domino else 5)
    state = drafter.state_dict()
    for key, value in tensors.items():
        loaded = state[key.removeprefix("model.")]
        assert loaded.dtype == torch.float32  # bf16 on disk, cast to the requested dtype
        assert torch.equal(loaded, value.float())


@pytest.mark.parametrize("domino", [False, True])
def test_save_load_round_trip_is_bit_exact(tmp_path: Path, domino: bool) -> None:
    src = _write(tmp_path / "src", _published_config(domino), _published_tensors(domino))
    first = load_drafter(src, dtype=torch.bfloat16)
    save_drafter(first, tmp_path / "a")
    second = load_drafter(tmp_path / "a", dtype=torch.bfloat16)
    save_drafter(second, tmp_path / "b")
    original = load_file(str(src / "model.safetensors"))
    saved = load_file(str(tmp_path / "a" / "model.safetensors"))
    assert original.keys() == saved.keys()
    for k in original:
        assert torch.equal(original[k].view(torch.int16), saved[k].view(torch.int16)), k
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert json.loads((tmp_path / "a" / "config.json").read_text()) == json.loads(
        (tmp_path / "b" / "config.json").read_text()
    )
    # The saved config keeps the published field names where a loader expects them.
    saved_cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert saved_cfg["dflash_config"]["target_layer_ids"] == [1, 2]
    assert saved_cfg["block_size"] == 6
    if domino:
        assert saved_cfg["dflash_config"]["projector_type"] == "domino"
        assert saved_cfg["dflash_config"]["shift_label"] is True


def test_extensions_round_trip(tmp_path: Path) -> None:
    """Restricted draft vocabulary and learned mask embedding survive save -> load."""
    drafter = tiny_drafter(draft_vocab_size=32, use_mask_embedding=True, mask_token_id=None)
    with torch.no_grad():
        drafter.draft_vocab_ids.copy_(torch.arange(0, 128, 4))
        drafter.mask_embedding.normal_()
    save_drafter(drafter, tmp_path / "ext", dtype=torch.float32)
    loaded = load_drafter(tmp_path / "ext", dtype=torch.float32, target_config=tiny_target().config)
    assert loaded.config.draft_vocab_size == 32 and loaded.config.use_mask_embedding
    assert torch.equal(loaded.draft_vocab_ids, drafter.draft_vocab_ids)
    assert loaded.draft_vocab_ids.dtype == torch.long
    assert torch.equal(loaded.mask_embedding, drafter.mask_embedding)
    assert loaded.embed_proj[2].weight.shape == (32, 8)


def _fails(tmp_path: Path, cfg: dict, tensors: dict, match: str, target_layers: int = 4) -> None:
    ckpt = _write(tmp_path / "bad", cfg, tensors)
    with pytest.raises(CheckpointError, match=match):
        load_drafter(ckpt, target_config=tiny_target(layers=target_layers).config)


def test_missing_key_is_named(tmp_path: Path) -> None:
    tensors = _published_tensors(True)
    del tensors["layers.1.mlp.up_proj.weight"]
    _fails(tmp_path, _published_config(True), tensors, r"missing keys \['layers.1.mlp.up_proj.weight'\]")


def test_unexpected_key_is_named(tmp_path: Path) -> None:
    tensors = _published_tensors(False) | {"extra.weight": torch.zeros(2)}
    _fails(tmp_path, _published_config(False), tensors, "unexpected keys")


def test_wrong_shape_is_named(tmp_path: Path) -> None:
    tensors = _published_tensors(True)
    tensors["embed_proj.0.weight"] = torch.zeros(R + 1, H + G, dtype=torch.bfloat16)
    _fails(tmp_path, _published_config(True), tensors, r"'embed_proj.0.weight' has shape \[9, 88\]")


def test_wrong_hidden_size_names_both_values(tmp_path: Path) -> None:
    cfg = _published_config(False)
    cfg["hidden_size"] = 32
    _fails(tmp_path, cfg, _published_tensors(False), "hidden_size 32 does not match the target's hidden_size 64")


def test_taps_beyond_target_depth(tmp_path: Path) -> None:
    cfg = _published_config(False)
    cfg["dflash_config"]["target_layer_ids"] = [1, 5]
    _fails(tmp_path, cfg, _published_tensors(False), r"target_layer_ids \[1, 5\] include \[5\].*4 layers")


def test_mask_token_outside_vocab(tmp_path: Path) -> None:
    cfg = _published_config(False)
    cfg["dflash_config"]["mask_token_id"] = 151669
    _fails(tmp_path, cfg, _published_tensors(False), "mask_token_id 151669 is outside.*vocab_size 128")


def test_vocab_mismatch(tmp_path: Path) -> None:
    cfg = _published_config(False)
    cfg["vocab_size"] = 256
    _fails(tmp_path, cfg, _published_tensors(False), "vocab_size 256 does not match the target's vocab_size 128")


def test_domino_without_shift_label(tmp_path: Path) -> None:
    cfg = _published_config(True)
    cfg["dflash_config"]["shift_label"] = False
    _fails(tmp_path, cfg, _published_tensors(True), "shift_label")


def test_unknown_architecture(tmp_path: Path) -> None:
    _fails(tmp_path, _published_config(False, arch="LlamaForCausalLM"), _published_tensors(False), "architectures")


def test_missing_required_field(tmp_path: Path) -> None:
    cfg = _published_config(False)
    del cfg["intermediate_size"]
    _fails(tmp_path, cfg, _published_tensors(False), "'intermediate_size' is missing")


def test_truncated_weights(tmp_path: Path) -> None:
    ckpt = _write(tmp_path / "t", _published_config(False), _published_tensors(False))
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="unreadable safetensors"):
        load_drafter(ckpt)


def test_garbage_config(tmp_path: Path) -> None:
    ckpt = _write(tmp_path / "g", _published_config(False), _published_tensors(False))
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="invalid JSON"):
        load_drafter(ckpt)


def test_missing_files(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="config.json not found"):
        load_drafter(tmp_path / "nowhere")


def test_saved_drafter_drafts_like_the_original(tmp_path: Path) -> None:
    drafter = tiny_drafter()
    save_drafter(drafter, tmp_path / "d", dtype=torch.float32)
    loaded: Drafter = load_drafter(tmp_path / "d", dtype=torch.float32)
    for (k1, v1), (k2, v2) in zip(sorted(drafter.state_dict().items()), sorted(loaded.state_dict().items())):
        assert k1 == k2 and torch.equal(v1, v2)
    # The GRU module's flat weights must follow the loaded parameters.
    x = torch.randn(2, 3, 64)
    torch.testing.assert_close(drafter.prefix_gru(x)[0], loaded.prefix_gru(x)[0])
