"""Log-probabilities the API returns: of committed tokens (`logprobs`) and of a prompt's own tokens
(`prompt_logprobs`, echo scoring), from the target's raw logits, before temperature."""

from __future__ import annotations

from collections.abc import Callable

import torch

from model.engine.requests import TokenLogprob

PROMPT_LOGPROB_CHUNK = 256  # prompt positions per LM-head call when scoring a prompt


def token_logprobs(logits: torch.Tensor, token_ids: list[int], top_n: int) -> list[TokenLogprob]:
    """Each token's log-probability and the `top_n` most likely alternatives, from logits [n, V] at
    the positions that produced `token_ids`."""
    lp = torch.log_softmax(logits[: len(token_ids)].float(), dim=-1)
    chosen = lp.gather(-1, torch.tensor(token_ids, device=lp.device)[:, None]).squeeze(-1).tolist()
    if top_n > 0:
        top_v, top_i = lp.topk(top_n, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(top_i.tolist(), top_v.tolist())]
    else:
        tops = [[] for _ in token_ids]
    return [TokenLogprob(tok, val, top) for tok, val, top in zip(token_ids, chosen, tops)]


def prompt_logprobs(
    lm_head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, prompt_ids: list[int], top_n: int
) -> list[TokenLogprob]:
    """Logprobs of prompt tokens 1..n-1 from one row's prefill hidden states [T, H] (position t
    predicts token t + 1). The LM head runs in chunks: [T, V] logits of a long prompt would be
    hundreds of MB."""
    out: list[TokenLogprob] = []
    for s in range(0, len(prompt_ids) - 1, PROMPT_LOGPROB_CHUNK):
        e = min(s + PROMPT_LOGPROB_CHUNK, len(prompt_ids) - 1)
        out += token_logprobs(lm_head(hidden[s:e]), prompt_ids[s + 1 : e + 1], top_n)
    return out
