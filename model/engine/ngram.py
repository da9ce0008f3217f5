"""Prompt-lookup (n-gram) proposals: drafts copied from the row's own prompt and output.

Where an answer repeats its context (code edits, quotes, lists, templated text), the tokens that
followed the last occurrence of the current suffix are a free draft: no drafter forward at all.
`NgramIndex` keeps, per row, a dict per n-gram length from each n-gram to where it last ended, updated
as tokens commit, so a lookup costs at most (max_n - min_n + 1) dict probes however long the row is.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NgramProposal:
    tokens: list[int]  # proposed continuation (1..max_tokens tokens)
    match_len: int  # n of the matched suffix


class NgramIndex:
    """Latest end position of every n-gram (min_n <= n <= max_n) of one token sequence.

    An n-gram enters the index only once the token after it exists, so the current suffix never
    matches itself and every hit has at least one token to propose.
    """

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n = max_n
        self.min_n = min_n
        self.tokens: list[int] = []
        # ends[n - min_n][gram] = e: tokens[e - n : e] == gram, with tokens[e] following it.
        self.ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n - min_n + 1)]

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append committed tokens and index the n-grams they complete a continuation for."""
        seq = self.tokens
        for tok in tokens:
            e = len(seq)  # position of the token being appended
            for n in range(self.min_n, min(self.max_n, e) + 1):
                self.ends[n - self.min_n][tuple(seq[e - n : e])] = e
            seq.append(int(tok))

    def propose(self, max_tokens: int) -> NgramProposal | None:
        """Continuation of the most recent earlier occurrence of the longest matching suffix."""
        seq = self.tokens
        if max_tokens < 1:
            return None
        for n in range(min(self.max_n, len(seq)), self.min_n - 1, -1):
            e = self.ends[n - self.min_n].get(tuple(seq[len(seq) - n :]))
            if e is not None:
                # Copy as LZ77 does: past the end, the copy continues from its own output, so a
                # loop of period P yields max_tokens tokens, not just the P - 1 that exist.
                out = seq[e : e + max_tokens]
                while len(out) < max_tokens:
                    out.append(out[len(out) - (len(seq) - e)])
                return NgramProposal(out, n)
        return None
