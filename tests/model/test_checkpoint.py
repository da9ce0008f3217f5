"""Checkpoint I/O: the published DFlash and Domino layouts, round trips, and clear failures.

Over 500 lines: every field of both published layouts and each refusal has its own case."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.engine.engine import Engine, SamplingParams
from model.engine.sampling import SamplingBatch
from model.load.checkpoint import CheckpointError, load_drafter, save_drafter
from model.nn.drafter import Drafter, DraftResult, new_context_cache
from model.nn.target import TargetModel
from tests.helpers import tiny_drafter, tiny_target

SHIPPED = Path(__file__).resolve().parents[2] / "drafters" / "smollm2-135m-domino"

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


# -- drafting outputs, to compare drafters loaded different ways ---------------------------------


def _bind(drafter: Drafter, embed_scale: float = 1.0, seed: int = 5) -> Drafter:
    """Bind a fixed random target embedding (times `embed_scale`) and LM head."""
    g = torch.Generator().manual_seed(seed)
    embed, head = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g)
    drafter.bind_target(embed * embed_scale, head)
    return drafter


ANCHORS = torch.tensor([5, 17])


def _greedy() -> SamplingBatch:
    return SamplingBatch(torch.zeros(2), torch.ones(2), torch.zeros(2, dtype=torch.long))


@torch.no_grad()
def _block_hidden(drafter: Drafter) -> torch.Tensor:
    """Backbone hidden states [2, B, H] of two rows after ragged contexts (7 and 4 tokens)."""
    cfg = drafter.config
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(2, 7, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g)
    cache = new_context_cache(cfg, 2, 32, torch.float32, "cpu")
    drafter.append_context(cache, 0, feats, torch.tensor([7, 4]), [7, 4])
    block = torch.full((2, cfg.block_size), cfg.mask_token_id)
    block[:, 0] = ANCHORS
    return drafter.forward_block(cache, 0, block)


@torch.no_grad()
def _outputs(drafter: Drafter) -> tuple[torch.Tensor, DraftResult]:
    hidden = _block_hidden(drafter)
    return hidden, drafter.draft(hidden, ANCHORS, _greedy(), return_logits=True)


def _load(tmp_path: Path, name: str, cfg: dict, tensors: dict[str, torch.Tensor]) -> Drafter:
    return load_drafter(_write(tmp_path / name, cfg, tensors), target_config=tiny_target().config)


# -- 1. sharded safetensors ----------------------------------------------------------------------


def _write_sharded(tmp_path: Path) -> tuple[Path, Path]:
    """One drafter saved as a single file and as two shards plus a Hugging Face index."""
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    save_drafter(tiny_drafter(), single, dtype=torch.float32)
    state = load_file(str(single / "model.safetensors"))
    keys = sorted(state)  # the head (embed_proj, prefix_gru) lands in both halves
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    parts = {names[0]: keys[: len(keys) // 2], names[1]: keys[len(keys) // 2 :]}
    sharded.mkdir()
    shutil.copy(single / "config.json", sharded / "config.json")
    for name, part in parts.items():
        save_file({k: state[k] for k in part}, str(sharded / name), metadata={"format": "pt"})
    weight_map = {k: name for name, part in parts.items() for k in part}
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    return single, sharded


def test_sharded_checkpoint_loads_like_the_single_file(tmp_path: Path) -> None:
    single_dir, sharded_dir = _write_sharded(tmp_path)
    assert not (sharded_dir / "model.safetensors").exists()
    single, sharded = _bind(load_drafter(single_dir)), _bind(load_drafter(sharded_dir))
    a, b = single.state_dict(), sharded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    (h1, r1), (h2, r2) = _outputs(single), _outputs(sharded)
    assert torch.equal(h1, h2) and torch.equal(r1.logits, r2.logits) and torch.equal(r1.tokens, r2.tokens)


def test_sharded_checkpoint_names_a_missing_shard(tmp_path: Path) -> None:
    _, sharded = _write_sharded(tmp_path)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard model-00002-of-00002.safetensors .*not found"):
        load_drafter(sharded)


def test_sharded_index_naming_an_absent_key(tmp_path: Path) -> None:
    _, sharded = _write_sharded(tmp_path)
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["layers.9.mlp.up_proj.weight"] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"\['layers.9.mlp.up_proj.weight'\] are not in their shards"):
        load_drafter(sharded)


# -- 2. the legacy `logit_head.` container around the Domino head ---------------------------------


def _legacy_head(tensors: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    head = ("prefix_gru.", "embed_proj.")
    return {(prefix + "logit_head." + k if k.startswith(head) else prefix + k): v for k, v in tensors.items()}


@pytest.mark.parametrize("prefix", ["", "model."])
def test_legacy_logit_head_prefix_maps_to_the_domino_head(tmp_path: Path, prefix: str) -> None:
    tensors = _published_tensors(True)
    legacy = _legacy_head(tensors, prefix)
    assert any(k.startswith(prefix + "logit_head.prefix_gru.") for k in legacy)
    cfg = _published_config(True)
    new, old = _load(tmp_path, "new", cfg, tensors), _load(tmp_path, "old", cfg, legacy)
    a, b = new.state_dict(), old.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    (_, r1), (_, r2) = _outputs(_bind(new)), _outputs(_bind(old))
    assert torch.equal(r1.logits, r2.logits)


def test_legacy_and_current_head_keys_together_are_refused(tmp_path: Path) -> None:
    tensors = _published_tensors(True)
    both = tensors | {"logit_head.embed_proj.0.weight": tensors["embed_proj.0.weight"].clone()}
    _fails(tmp_path, _published_config(True), both, "'embed_proj.0.weight' is stored twice")


def test_other_logit_head_keys_stay_unexpected(tmp_path: Path) -> None:
    tensors = _published_tensors(True) | {"logit_head.markov_head.weight": torch.zeros(2)}
    _fails(tmp_path, _published_config(True), tensors, r"unexpected keys \['logit_head.markov_head.weight'\]")


# -- 3. a Domino head with shift_label false -------------------------------------------------------


def test_domino_without_shift_label_drafts_block_minus_one(tmp_path: Path) -> None:
    """SGLang's reading: outputs 1..B-1 are the drafts (the anchor's output is unused), the GRU
    starts from the anchor and slot 0 stays a pure draft, exactly as with shift_label on outputs 0..B-2."""
    tensors = _published_tensors(True)
    cfg = _published_config(True)
    shifted = _bind(_load(tmp_path, "shift", cfg, tensors))
    cfg["dflash_config"]["shift_label"] = False
    unshifted = _bind(_load(tmp_path, "noshift", cfg, tensors))
    assert unshifted.config.has_head and not unshifted.config.shift_label
    assert unshifted.config.num_drafts == 5 and unshifted.config.first_draft_position == 1

    hidden, result = _outputs(unshifted)
    assert result.tokens.shape == (2, 5)
    with torch.no_grad():
        same = shifted.draft(hidden[:, 1:], ANCHORS, _greedy(), return_logits=True)
        base = unshifted.base_logits(hidden[:, 1])
    assert torch.equal(result.tokens, same.tokens) and torch.equal(result.logits, same.logits)
    torch.testing.assert_close(result.logits[:, 0], base)  # pure_draft_prefix_len = 1: slot 0 is uncorrected


def test_domino_without_shift_label_serves_losslessly(tmp_path: Path) -> None:
    cfg = _published_config(True)
    cfg["dflash_config"]["shift_label"] = False
    drafter = _load(tmp_path, "noshift", cfg, _published_tensors(True))
    model = tiny_target()
    # The fixed policy verifies every draft, so the shifted-by-one slots really are checked.
    engine = Engine(
        TargetModel(model), drafter, mode="domino", max_batch_size=2, max_model_len=64, draft_policy="fixed"
    )
    prompts = [[3, 9, 27, 81, 5], [7, 1]]
    results = engine.generate(prompts, [SamplingParams(max_new_tokens=12)] * 2)
    for prompt, (tokens, stats, _) in zip(prompts, results):
        ids = torch.tensor([prompt])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        assert tokens == ref[0, len(prompt) :].tolist()
        assert stats.draft_tokens > 0


# -- 4. newer DFlash config fields -----------------------------------------------------------------


def _with(domino: bool, top: dict | None = None, nested: dict | None = None) -> dict:
    cfg = _published_config(domino)
    cfg.update(top or {})
    cfg["dflash_config"].update(nested or {})
    return cfg


# What a Hugging Face Qwen3 drafter config carries besides the drafter's fields, at values that
# change nothing.
NEUTRAL_TOP = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "bos_token_id": 1,
    "dtype": "bfloat16",
    "eos_token_id": 2,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "layer_types": ["full_attention", "full_attention"],
    "max_window_layers": 2,
    "pad_token_id": None,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000},
    "rope_scaling": None,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "transformers_version": "4.57.1",
    "use_cache": True,
    "use_sliding_window": False,
}
NEUTRAL_NESTED = {
    "is_causal": False,
    "input_embedding_scale": 1.0,
    "output_multiplier": 1.0,
    "final_logit_softcapping": None,
    "mask_token": "<|MASK|>",
}


@pytest.mark.parametrize("domino", [False, True])
def test_neutral_field_values_load_silently_and_change_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, domino: bool
) -> None:
    tensors = _published_tensors(domino)
    plain = _load(tmp_path, "plain", _published_config(domino), tensors)
    with caplog.at_level(logging.WARNING):
        neutral = _load(tmp_path, "neutral", _with(domino, NEUTRAL_TOP, NEUTRAL_NESTED), tensors)
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    (h1, r1), (h2, r2) = _outputs(_bind(plain)), _outputs(_bind(neutral))
    assert torch.equal(h1, h2) and torch.equal(r1.logits, r2.logits)


def test_input_embedding_scale_scales_the_block_input(tmp_path: Path) -> None:
    tensors = _published_tensors(False)
    scaled = _load(tmp_path, "scaled", _with(False, nested={"input_embedding_scale": 2.0}), tensors)
    plain = _load(tmp_path, "plain", _published_config(False), tensors)
    assert scaled.config.input_embedding_scale == 2.0
    # A plain drafter reading embeddings twice as large computes the same block.
    (h1, r1), (h2, r2) = _outputs(_bind(scaled)), _outputs(_bind(plain, embed_scale=2.0))
    torch.testing.assert_close(h1, h2)
    torch.testing.assert_close(r1.logits, r2.logits)
    _, r3 = _outputs(_bind(plain))
    assert not torch.allclose(r1.logits, r3.logits)


@pytest.mark.parametrize(("multiplier", "cap"), [(0.5, None), (None, 3.0), (0.5, 3.0)])
def test_output_multiplier_and_softcap_shape_the_base_logits(
    tmp_path: Path, multiplier: float | None, cap: float | None
) -> None:
    tensors = _published_tensors(False)
    # One field at the top level and one in dflash_config: both places are read.
    top = {} if multiplier is None else {"output_multiplier": multiplier}
    nested = {} if cap is None else {"final_logit_softcapping": cap}
    shaped = _load(tmp_path, "shaped", _with(False, top, nested), tensors)
    plain = _load(tmp_path, "plain", _published_config(False), tensors)
    (_, r1), (_, r2) = _outputs(_bind(shaped)), _outputs(_bind(plain))
    want = r2.logits
    if cap is not None:
        want = torch.tanh(want / cap) * cap  # the cap first, then the multiplier (vLLM's order)
        assert want.abs().max() < cap
    if multiplier is not None:
        want = want * multiplier
    torch.testing.assert_close(r1.logits, want)
    assert not torch.allclose(r1.logits, r2.logits)


@pytest.mark.parametrize(
    ("top", "nested", "match"),
    [
        ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 2048}, {}, "'layer_types'.*2048"),
        ({}, {"layer_types": ["sliding_attention"] * 2}, "'layer_types'.*'full_attention'"),
        ({"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 1}, {}, "'use_sliding_window'"),
        ({}, {"is_causal": True}, "'is_causal' is True.*is_causal false"),
        ({}, {"input_embedding_scale": 0.0}, "'input_embedding_scale' is 0.0"),
        ({}, {"input_embedding_scale": float("nan")}, "'input_embedding_scale' is nan"),
        ({"output_multiplier": -1.0}, {}, "'output_multiplier' is -1.0"),
        ({}, {"output_multiplier": "2"}, "'output_multiplier' is '2'"),
        ({}, {"final_logit_softcapping": -30.0}, "'final_logit_softcapping' is -30.0"),
        ({"hidden_act": "gelu"}, {}, "'hidden_act' is 'gelu'.*'silu'"),
    ],
)
def test_unhonoured_field_values_are_refused(tmp_path: Path, top: dict, nested: dict, match: str) -> None:
    _fails(tmp_path, _with(False, top, nested), _published_tensors(False), match)


def test_sliding_window_past_the_draft_layers_is_harmless(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Qwen3's rule: with `max_window_layers` >= the layer count no draft layer slides."""
    top = {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 2}
    with caplog.at_level(logging.WARNING):
        _load(tmp_path, "ok", _with(False, top), _published_tensors(False))
    assert not caplog.records


def test_unknown_fields_are_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = _with(True, {"conv_kernel_size": 2}, {"selector_rank": 256})
    with caplog.at_level(logging.WARNING, logger="model.load.checkpoint"):
        _load(tmp_path, "unknown", cfg, _published_tensors(True))
    records = [r for r in caplog.records if r.name == "model.load.checkpoint"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert "conv_kernel_size" in records[0].getMessage()
    assert "dflash_config.selector_rank" in records[0].getMessage()


@pytest.mark.parametrize(
    "top",
    [
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
        {"rope_scaling": {"type": "linear", "factor": 2.0}},
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
    ],
)
def test_rope_scaling_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture, top: dict) -> None:
    """The drafter's RoPE has no scaling: served anyway (verification keeps the output exact), with a warning."""
    cfg = _with(False, top)
    with caplog.at_level(logging.WARNING, logger="model.load.checkpoint"):
        _load(tmp_path, "yarn", cfg, _published_tensors(False))
    assert len(caplog.records) == 1 and "rope_scaling" in caplog.records[0].getMessage()


def test_shipped_checkpoint_loads_without_warnings(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="model.load.checkpoint"):
        drafter = load_drafter(SHIPPED)
    assert drafter.config.has_head
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_new_fields_round_trip(tmp_path: Path) -> None:
    drafter = tiny_drafter(domino=False, input_embedding_scale=2.0, output_multiplier=0.5, final_logit_softcapping=30.0)
    save_drafter(drafter, tmp_path / "d", dtype=torch.float32)
    saved = json.loads((tmp_path / "d" / "config.json").read_text())["dflash_config"]
    assert (saved["input_embedding_scale"], saved["output_multiplier"], saved["final_logit_softcapping"]) == (
        2.0,
        0.5,
        30.0,
    )
    loaded = load_drafter(tmp_path / "d")
    cfg = loaded.config
    assert (cfg.input_embedding_scale, cfg.output_multiplier, cfg.final_logit_softcapping) == (2.0, 0.5, 30.0)
    # Defaults are not written: a plain drafter's config.json stays the published layout.
    save_drafter(tiny_drafter(domino=False), tmp_path / "p")
    plain = json.loads((tmp_path / "p" / "config.json").read_text())
    assert "input_embedding_scale" not in plain["dflash_config"] and "output_multiplier" not in plain
