"""A new drafter for a target: its config, initial weights and draft vocabulary."""

from __future__ import annotations

import copy

import torch

from model.nn.drafter import Drafter, DrafterConfig, default_target_layer_ids
from model.nn.target import TargetModel
from train.config import DrafterSpec

DEFAULT_BLOCK_SIZE = 8  # a new drafter's block when --block-size is not given
DEFAULT_RANK = 64  # a new drafter's correction rank when --rank is not given
DEFAULT_LAYERS = 1  # a new drafter's depth when --layers is not given
DEFAULT_DRAFT_VOCAB = 8192  # a new drafter's draft vocabulary when --draft-vocab is not given


def make_drafter_config(spec: DrafterSpec, target: TargetModel, draft_vocab_size: int | None) -> DrafterConfig:
    """A new drafter's config for `target`: its widths, the spec's shape, the defaults above."""
    tcfg = target.config
    layers = spec.layers or DEFAULT_LAYERS
    taps = spec.taps or default_target_layer_ids(target.num_layers, layers)
    rope_theta = getattr(tcfg, "rope_theta", None) or (getattr(tcfg, "rope_parameters", None) or {}).get(
        "rope_theta", 10000.0
    )
    return DrafterConfig(
        hidden_size=target.hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=int(tcfg.num_attention_heads),
        num_key_value_heads=target.kv_heads,
        head_dim=target.head_dim,
        intermediate_size=int(tcfg.intermediate_size),
        vocab_size=target.vocab_size,
        block_size=spec.block_size or DEFAULT_BLOCK_SIZE,
        target_layer_ids=list(taps),
        num_target_layers=target.num_layers,
        mask_token_id=spec.mask_token_id,
        rms_norm_eps=float(getattr(tcfg, "rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=int(getattr(tcfg, "max_position_embeddings", 8192)),
        projector_type="domino" if spec.head else None,
        gru_hidden_dim=spec.gru_size,
        emb_dim=spec.rank or DEFAULT_RANK,
        shift_label=spec.shift_label,
        draft_vocab_size=draft_vocab_size,
        use_mask_embedding=spec.mask_token_id is None,
        qk_norm=spec.qk_norm,
    )


def init_weights(drafter: Drafter) -> None:
    """Published-style init: matrices N(0, 0.02), norms at one, the mask embedding small."""
    for name, p in drafter.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
        elif "norm" in name:
            torch.nn.init.ones_(p)
        elif name == "mask_embedding":
            torch.nn.init.normal_(p, std=0.02)


def warm_start(drafter: Drafter, target: TargetModel) -> None:
    """Copy the target's top decoder layer into every draft layer; `fc` passes the last tap through."""
    top = target.decoder.layers[-1]
    src = {k: v for k, v in top.state_dict().items()}
    with torch.no_grad():
        for layer in drafter.layers:
            for name, param in layer.state_dict().items():
                if name in src and src[name].shape == param.shape:
                    param.copy_(src[name])
        h = drafter.config.hidden_size
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, -h:] = torch.eye(h)
        drafter.norm.weight.copy_(target.decoder.norm.weight)


def rebuild_draft_vocab(drafter: Drafter, counts: torch.Tensor) -> None:
    """Make the draft vocabulary the most frequent tokens of `counts` [Vt]. The base logits borrow
    the target's LM-head rows, so any token set works at once; the head's learned correction rows
    are kept for tokens in both sets, and new tokens start with none."""
    size = drafter.config.draft_vocab_size
    assert size is not None
    new_ids = counts.argsort(descending=True, stable=True)[:size].sort().values
    with torch.no_grad():
        if drafter.config.has_head:
            weight = drafter.embed_proj[2].weight  # [V_draft, rank]
            old_row = torch.full((counts.numel(),), -1, dtype=torch.long)
            old_row[drafter.draft_vocab_ids.cpu()] = torch.arange(size)
            src = old_row[new_ids].to(weight.device)
            remapped = torch.zeros_like(weight)
            remapped[src >= 0] = weight[src[src >= 0]]
            weight.copy_(remapped)
        drafter.draft_vocab_ids.copy_(new_ids.to(drafter.draft_vocab_ids.device))


def widen_draft_vocab(drafter: Drafter, counts: torch.Tensor, size: int) -> None:
    """Grow the draft vocabulary in place to `size` tokens: every current token stays, the most
    frequent others of `counts` [Vt] join it. A new token's base logit is the target's LM-head row
    (borrowed, nothing to learn), so slot 0, which has no correction, proposes it at once. Its
    correction row starts as the mean of the learned ones: the learned rows share a large common
    part (a zero row would let every new token outbid the learned ones at the corrected slots)."""
    cfg = drafter.config
    old = cfg.draft_vocab_size
    if old is None:
        raise ValueError("the drafter already drafts from the full vocabulary")
    size = min(size, counts.numel())
    if size < old:
        raise ValueError(f"--draft-vocab {size} is below the drafter's {old}; a draft vocabulary can only be widened")
    if size == old:
        return
    old_ids = drafter.draft_vocab_ids.cpu()
    ranked = counts.clone().float()
    ranked[old_ids] = float("inf")  # the current tokens come first, whatever their counts here
    new_ids = ranked.argsort(descending=True, stable=True)[:size].sort().values
    dev = drafter.draft_vocab_ids.device
    if cfg.has_head:
        w2 = drafter.embed_proj[2]
        new_w2 = torch.nn.Linear(w2.in_features, size, bias=False, dtype=w2.weight.dtype, device=w2.weight.device)
        old_row = torch.full((counts.numel(),), -1, dtype=torch.long)
        old_row[old_ids] = torch.arange(old)
        src = old_row[new_ids].to(w2.weight.device)
        with torch.no_grad():
            new_w2.weight.copy_(w2.weight.mean(dim=0, keepdim=True).expand(size, -1))
            new_w2.weight[src >= 0] = w2.weight[src[src >= 0]]
        drafter.embed_proj[2] = new_w2
    drafter.draft_vocab_ids = new_ids.to(dev)  # a registered buffer: replaced, still saved
    cfg.draft_vocab_size = size


def draft_vocab_map(drafter: Drafter, target_vocab: int) -> torch.Tensor | None:
    """Target id -> draft-vocabulary row ([Vt], -1 outside), or None for a full-vocabulary drafter."""
    if drafter.config.draft_vocab_size is None:
        return None
    vocab_map = torch.full((target_vocab,), -1, dtype=torch.long, device=drafter.draft_vocab_ids.device)
    vocab_map[drafter.draft_vocab_ids] = torch.arange(drafter.config.draft_vocab_size, device=vocab_map.device)
    return vocab_map


def widen_head(drafter: Drafter, rank: int) -> None:
    """Raise the head's correction rank in place without changing what the drafter computes.

    The old W1 rows and W2 columns are kept. The new W1 rows start random and the new W2 columns
    at zero, so the new units add nothing yet but receive a gradient at once (with both at zero
    neither would ever move).
    """
    cfg = drafter.config
    if not cfg.has_head:
        raise ValueError("a DFlash drafter has no head to widen")
    old = cfg.emb_dim
    if rank < old:
        raise ValueError(f"--rank {rank} is below the drafter's rank {old}; a head can only be widened")
    if rank == old:
        return
    w1, w2 = drafter.embed_proj[0], drafter.embed_proj[2]
    new_w1 = torch.nn.Linear(w1.in_features, rank, bias=False, dtype=w1.weight.dtype, device=w1.weight.device)
    new_w2 = torch.nn.Linear(rank, w2.out_features, bias=False, dtype=w2.weight.dtype, device=w2.weight.device)
    with torch.no_grad():
        torch.nn.init.normal_(new_w1.weight, std=0.02)
        new_w1.weight[:old] = w1.weight
        new_w2.weight.zero_()
        new_w2.weight[:, :old] = w2.weight
    drafter.embed_proj[0], drafter.embed_proj[2] = new_w1, new_w2
    cfg.emb_dim = rank


def deepen(drafter: Drafter, layers: int) -> None:
    """Add layers on top of the drafter's last one without changing what it computes.

    Each new layer is a copy of the last one with its attention output and MLP down projections at
    zero, so both residual branches add nothing yet; those projections get a gradient at once (their
    inputs are not zero), and the copied rest starts from weights that already read the context.
    Every layer reads the same projected context, so the new ones need no new context path.
    """
    old = len(drafter.layers)
    if layers < old:
        raise ValueError(f"--layers {layers} is below the drafter's {old}; a drafter can only be deepened")
    for _ in range(layers - old):
        layer = copy.deepcopy(drafter.layers[-1])
        with torch.no_grad():
            for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                proj.weight.zero_()
                if proj.bias is not None:
                    proj.bias.zero_()
        drafter.layers.append(layer)
    drafter.config.num_hidden_layers = layers


def average_drafters(drafters: list[Drafter], weights: list[float] | None = None) -> Drafter:
    """A drafter whose floating-point weights are the weighted mean of `drafters`' (a weight soup).

    Only drafters fine-tuned from one checkpoint average into something useful: they must share the
    config and the draft vocabulary, and in practice an initialisation, so that their weights lie in
    one basin. Returns a new drafter; the inputs are left as they were.
    """
    if not drafters:
        raise ValueError("no drafters to average")
    weights = weights if weights is not None else [1.0] * len(drafters)
    if len(weights) != len(drafters) or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError("need one non-negative weight per drafter, not all zero")
    first = drafters[0]
    states = [d.state_dict() for d in drafters]
    for i, (d, state) in enumerate(zip(drafters[1:], states[1:], strict=True), start=1):
        if d.config != first.config:
            raise ValueError(f"drafter {i} has another config than drafter 0; only like drafters average")
        for name, tensor in state.items():
            if not tensor.is_floating_point() and not torch.equal(tensor, states[0][name]):
                raise ValueError(f"drafter {i} differs from drafter 0 in '{name}' (e.g. its draft vocabulary)")
    total = float(sum(weights))
    mean = {}
    for name, tensor in states[0].items():
        if tensor.is_floating_point():
            acc = sum(w * s[name].float() for w, s in zip(weights, states, strict=True)) / total
            mean[name] = acc.to(tensor.dtype)
        else:
            mean[name] = tensor.clone()
    out = copy.deepcopy(first)
    out.load_state_dict(mean)
    return out
