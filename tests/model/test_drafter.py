"""The drafter module: GRU recurrence, ragged batching, non-causal blocks, published sizes."""

from __future__ import annotations

import torch

from model.engine.sampling import SamplingBatch
from model.nn.drafter import (
    Drafter,
    DrafterConfig,
    count_parameters,
    default_target_layer_ids,
    gru_cell,
    new_context_cache,
)
from tests.helpers import tiny_drafter


def _bound(drafter: Drafter, vocab: int = 128, hidden: int = 64, seed: int = 5) -> Drafter:
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(vocab, hidden, generator=g)
    head = torch.randn(vocab, hidden, generator=g)
    drafter.bind_target(embed, head)
    return drafter


def _greedy(r: int) -> SamplingBatch:
    return SamplingBatch(torch.zeros(r), torch.ones(r), torch.zeros(r, dtype=torch.long))


def test_gru_cell_matches_torch_gru() -> None:
    torch.manual_seed(0)
    gru = torch.nn.GRU(12, 7, num_layers=1, bias=False, batch_first=True)
    x = torch.randn(3, 5, 12)
    expected, _ = gru(x)
    h = torch.zeros(3, 7)
    steps = []
    for t in range(5):
        h = gru_cell(x[:, t], h, gru.weight_ih_l0, gru.weight_hh_l0)
        steps.append(h)
    torch.testing.assert_close(torch.stack(steps, 1), expected, rtol=1e-5, atol=1e-6)


def test_default_taps_match_published_rule() -> None:
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(30, 1) == [15]


def _context_and_blocks(drafter: Drafter, lengths: list[int], anchors: list[int], seed: int = 3):
    """Features for rows of different context lengths, appended in two ragged chunks."""
    g = torch.Generator().manual_seed(seed)
    k = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    feats = [torch.randn(n, k, generator=g) for n in lengths]
    block = torch.full((len(lengths), drafter.config.block_size), drafter.config.mask_token_id)
    block[:, 0] = torch.tensor(anchors)
    return feats, block


def _run_batch(
    drafter: Drafter, feats: list[torch.Tensor], block: torch.Tensor, lo: int = 0, num_outputs: int | None = None
):
    r = len(feats)
    cache = new_context_cache(drafter.config, lo + r, 64, torch.float32, "cpu")
    # Append each row's context in two uneven, ragged chunks to exercise per-row offsets.
    for part in (0, 1):
        chunks = [f[: len(f) // 2] if part == 0 else f[len(f) // 2 :] for f in feats]
        t = max(len(c) for c in chunks)
        padded = torch.zeros(r, t, feats[0].shape[1])
        for i, c in enumerate(chunks):
            padded[i, : len(c)] = c
        counts = [len(c) for c in chunks]
        drafter.append_context(cache, lo, padded, torch.tensor(counts), counts)
    hidden = drafter.forward_block(cache, lo, block, num_outputs=num_outputs)
    return hidden, cache


def test_batched_drafting_equals_each_row_alone() -> None:
    drafter = _bound(tiny_drafter())
    lengths, anchors = [3, 11, 6], [5, 17, 99]
    feats, block = _context_and_blocks(drafter, lengths, anchors)
    hidden, cache = _run_batch(drafter, feats, block)
    assert cache.lengths.tolist() == cache.host_lengths == lengths
    batched = drafter.draft(hidden, block[:, 0], _greedy(3))
    for i in range(3):
        alone_hidden, _ = _run_batch(drafter, [feats[i]], block[i : i + 1], lo=2)
        torch.testing.assert_close(hidden[i : i + 1], alone_hidden, rtol=1e-5, atol=1e-5)
        alone = drafter.draft(alone_hidden, block[i : i + 1, 0], _greedy(1))
        assert batched.tokens[i].tolist() == alone.tokens[0].tolist()
        torch.testing.assert_close(batched.token_probs[i], alone.token_probs[0], rtol=1e-5, atol=1e-6)
    assert batched.tokens.shape == (3, drafter.config.num_drafts)


def test_drafting_fewer_slots_gives_the_same_leading_drafts() -> None:
    drafter = _bound(tiny_drafter())
    feats, block = _context_and_blocks(drafter, [3, 11, 6], [5, 17, 99])
    hidden, _ = _run_batch(drafter, feats, block)
    full = drafter.draft(hidden, block[:, 0], _greedy(3))
    for slots in (1, 2, drafter.config.num_drafts - 1):
        part = drafter.draft(hidden, block[:, 0], _greedy(3), num_slots=slots)
        assert part.tokens.shape == (3, slots)
        assert part.tokens.tolist() == full.tokens[:, :slots].tolist()
        torch.testing.assert_close(part.confidence, full.confidence[:, :slots])
        # Finishing only the positions those slots read (the last layer's MLP) changes nothing.
        short, _ = _run_batch(drafter, feats, block, num_outputs=slots)
        assert short.shape[1] == slots
        torch.testing.assert_close(short, hidden[:, :slots], rtol=1e-5, atol=1e-5)
        cut = drafter.draft(short, block[:, 0], _greedy(3), num_slots=slots)
        assert cut.tokens.tolist() == part.tokens.tolist()


def test_block_attention_is_non_causal() -> None:
    drafter = _bound(tiny_drafter(use_mask_embedding=False))
    feats, block = _context_and_blocks(drafter, [4], [9])
    hidden, _ = _run_batch(drafter, feats, block)
    changed = block.clone()
    changed[0, -1] = 42  # a later position of the block
    hidden2, _ = _run_batch(drafter, feats, changed)
    # Earlier slots (the anchor's included) see the later token: no causal mask inside the block.
    assert not torch.allclose(hidden[0, 0], hidden2[0, 0])
    assert not torch.allclose(hidden[0, 1], hidden2[0, 1])


def test_context_is_row_local() -> None:
    """Changing one row's context leaves the other rows' blocks untouched."""
    drafter = _bound(tiny_drafter())
    feats, block = _context_and_blocks(drafter, [5, 8], [1, 2])
    hidden, _ = _run_batch(drafter, feats, block)
    feats2 = [feats[0], feats[1] + 1.0]
    hidden2, _ = _run_batch(drafter, feats2, block)
    torch.testing.assert_close(hidden[0], hidden2[0])
    assert not torch.allclose(hidden[1], hidden2[1])


def test_head_switch_changes_only_corrected_slots() -> None:
    drafter = _bound(tiny_drafter())
    feats, block = _context_and_blocks(drafter, [6], [3])
    hidden, _ = _run_batch(drafter, feats, block)
    with_head = drafter.draft(hidden, block[:, 0], _greedy(1))
    drafter.use_head = False
    without = drafter.draft(hidden, block[:, 0], _greedy(1))
    drafter.use_head = True
    # Slot 0 is a pure draft (pure_draft_prefix_len = 1): identical either way.
    assert with_head.tokens[0, 0] == without.tokens[0, 0]
    base = drafter.base_logits(hidden[:, 0:])
    assert without.tokens[0].tolist() == base.argmax(-1)[0].tolist()


def test_dflash_layout_drafts_block_minus_one() -> None:
    drafter = _bound(tiny_drafter(domino=False))
    feats, block = _context_and_blocks(drafter, [5], [3])
    hidden, _ = _run_batch(drafter, feats, block)
    result = drafter.draft(hidden, block[:, 0], _greedy(1))
    assert result.tokens.shape == (1, drafter.config.block_size - 1)
    # Output j (j >= 1) predicts block position j: slot 0 (the anchor) is not a draft.
    assert result.tokens[0].tolist() == drafter.base_logits(hidden[:, 1:]).argmax(-1)[0].tolist()


def test_sampled_drafts_report_their_probability() -> None:
    drafter = _bound(tiny_drafter())
    feats, block = _context_and_blocks(drafter, [5, 7], [3, 4])
    hidden, _ = _run_batch(drafter, feats, block)
    d = drafter.config.num_drafts
    sampling = SamplingBatch(
        torch.tensor([0.8, 1.0]), torch.tensor([0.9, 1.0]), torch.tensor([0, 10]), torch.rand(2, d)
    )
    result = drafter.draft(hidden, block[:, 0], sampling)
    assert result.draft_probs is not None and result.draft_probs.shape == (2, d, 128)
    chosen = result.draft_probs.gather(-1, result.tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(chosen, result.token_probs)
    assert bool((result.token_probs > 0).all())
    # top-k 10 in row 1: every distribution keeps at most 10 tokens.
    assert int((result.draft_probs[1] > 0).sum(-1).max()) <= 10


def _published_qwen3_8b_domino() -> DrafterConfig:
    return DrafterConfig(
        hidden_size=4096,
        num_hidden_layers=5,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=12288,
        vocab_size=151936,
        block_size=16,
        target_layer_ids=default_target_layer_ids(36, 5),
        num_target_layers=36,
        mask_token_id=151669,
        projector_type="domino",
        shift_label=True,
        gru_hidden_dim=1024,
        emb_dim=256,
    )


def test_published_qwen3_8b_domino_sizes() -> None:
    with torch.device("meta"):
        drafter = Drafter(_published_qwen3_8b_domino())
    counts = count_parameters(drafter)
    print(f"Qwen3-8B Domino drafter: backbone {counts['backbone'] / 1e9:.3f} B, head {counts['head'] / 1e6:.1f} M")
    assert abs(counts["backbone"] - 1.05e9) / 1.05e9 < 0.02
    assert abs(counts["head"] - 56e6) / 56e6 < 0.02
