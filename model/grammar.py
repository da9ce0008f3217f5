"""Constrained decoding with llguidance (docs/design.md §1.6).

`GrammarCompiler` wraps one served tokenizer; `json_schema`, `json_object` and `lark` turn a request
into a checked `Grammar` (ValueError naming the problem otherwise: the API answers 400). Each row gets
its own `GrammarMatcher`, which the row's `RowProcessor` asks for the allowed tokens at every verify
position: the matcher walks the row's drafts (mask after d1..dj for position j), stops at the first
draft the grammar refuses (that draft has target probability 0 under the mask, so it is rejected and
nothing after it is used) and rolls back to the committed prefix; `commit` then advances it by the
tokens the row actually kept.

Why llguidance rather than xgrammar (measured on the SmolLM2 tokenizer, 49k tokens, docs/benchmarks.md):
both compute a mask in microseconds once warm (llguidance ~9 µs, xgrammar ~4 µs per token), far below
the ~0.3 ms of applying any mask to the logits; llguidance compiles a schema in ~8 ms (xgrammar ~70
ms), has no per-schema precompute, and installs as one 3 MB wheel with no dependencies, where
xgrammar 0.2.8 pulls in triton and apache-tvm-ffi.

JSON is compact with ", " and ": " separators and no other whitespace: free whitespace lets a weak
model pad forever (a known failure of flexible-whitespace JSON grammars), and one canonical spelling
is also what the drafter and n-gram copies can predict.
"""

from __future__ import annotations

import json
from typing import Any

import torch

# Compact JSON in the spelling json.dumps uses by default.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_SCHEMA_CHARS = 1 << 16
# What may come before the constrained answer of a reasoning model: nothing, an optional
# `<think>...</think>` block, or (the prompt opened it) the rest of one. The block's text is free
# but ends at the first `</think>` (`&`/`~`: llguidance's regex intersection and complement) and at
# most two whitespace characters after it (Qwen3 writes "\n\n"; more would let a model pad forever).
THINK = {
    "none": "",
    "optional": "think?",
    "open": "think",
}
_THINK_TEXT = r"(?s:.*)<\/think>[ \n]{0,2}/ & ~/(?s:.*<\/think>.*<\/think>.*)/"
# Unpacks llguidance's bitmask (bit t % 32 of int32 word t // 32 is token t) by shifting every word
# 0..31 places: ~30 µs for a 49k vocabulary, 5x faster than a byte lookup table.
_SHIFTS = torch.arange(32, dtype=torch.int32)


class GrammarCompiler:
    """Grammars over one tokenizer; vocab_size is the target's (rows past the tokenizer are never allowed)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        import llguidance
        import llguidance.hf

        self._llg = llguidance
        self.vocab_size = vocab_size
        self.eos_ids = frozenset(eos_token_ids)
        # ~1 s for a 150k vocabulary: build once per server.
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        # llguidance matches a tokenizer's added tokens (Qwen3's <think>, <tool_call>, ...) only by name
        # (`<think>` in Lark), never by their text: a tag that is one such token is written that way.
        added = set(tokenizer.get_added_vocab())
        tags = ("<think>", "</think>", "<tool_call>", "</tool_call>")
        self.tag = {t: t if t in added else json.dumps(t) for t in tags}

    def _checked(self, grammar: str) -> Grammar:
        is_error, messages = self._llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            message = messages[0] if messages else "invalid grammar"
            # A schema's error without the position in our own Lark wrapper.
            cut = message.find("failed to compile JSON schema: ")
            raise ValueError(message[cut + len("failed to compile ") :] if cut >= 0 else message)
        return Grammar(self, grammar)

    def json_schema(self, schema: Any, think: str = "none") -> Grammar:
        """Output that validates against schema (after a thinking block, see THINK)."""
        return self.lark(f"start: {THINK[think]} answer\nanswer: {_json(schema)}\n{self._think_rule(think)}")

    def json_object(self, think: str = "none") -> Grammar:
        return self.json_schema({"type": "object"}, think)

    def tool_calls(self, tools: dict[str, Any], parallel: bool, think: str = "none") -> Grammar:
        """One Hermes/Qwen3 `<tool_call>` block (or several, one a line, when parallel) calling one of
        tools (name -> parameters schema, None: any object), as app/tool_parser.py reads them."""
        options = []
        for name, parameters in tools.items():
            options.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "arguments": parameters or {"type": "object"}},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
            )
        body = options[0] if len(options) == 1 else {"anyOf": options}
        calls = 'call ("\\n" call)*' if parallel else "call"
        return self.lark(
            f"start: {THINK[think]} {calls}\n"
            f'call: {self.tag["<tool_call>"]} "\\n" body "\\n" {self.tag["</tool_call>"]}\n'
            f"body: {_json(body)}\n{self._think_rule(think)}"
        )

    def _think_rule(self, think: str) -> str:
        if think == "none":
            return ""
        opening = "" if think == "open" else self.tag["<think>"]
        if self.tag["</think>"] == "</think>":  # one token: the free text ends where it comes
            body = r"THINK_BODY: /(?s:.*)/ & ~/(?s:.*<\/think>.*)/" + "\n" + r"THINK_WS: /[ \n]{0,2}/"
            return f"think: {opening} THINK_BODY </think> THINK_WS\n{body}\n"
        opening = "" if think == "open" else r"<think>"
        return f"think: THINK_TEXT\nTHINK_TEXT: /{opening}{_THINK_TEXT}\n"

    def lark(self, text: str) -> Grammar:
        return self._checked(self._llg.LLMatcher.grammar_from_lark(text))


def _json(schema: Any) -> str:
    """A Lark `%json` rule body for schema, in the compact spelling."""
    if not isinstance(schema, dict):
        raise ValueError("the schema must be a JSON object")
    text = json.dumps({**schema, "x-guidance": JSON_OPTIONS})
    if len(text) > MAX_SCHEMA_CHARS:
        raise ValueError(f"the schema must be at most {MAX_SCHEMA_CHARS} characters as JSON")
    return "%json " + text


class Grammar:
    """A checked grammar; `matcher()` starts a row on it."""

    def __init__(self, compiler: GrammarCompiler, text: str) -> None:
        self.compiler = compiler
        self.text = text

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self.compiler, self.text)


class GrammarMatcher:
    """One row's position in its grammar (model.logits_processors.Matcher)."""

    def __init__(self, compiler: GrammarCompiler, grammar: str) -> None:
        import llguidance.torch

        self._fill = llguidance.torch.fill_next_token_bitmask
        self.eos_ids = compiler.eos_ids
        self.vocab_size = compiler.vocab_size
        self.matcher = compiler._llg.LLMatcher(compiler.tokenizer, grammar)
        if self.matcher.is_error():
            raise ValueError(self.matcher.get_error())
        self.words = (self.vocab_size + 31) // 32

    def allowed(self, drafts: list[int], positions: int) -> torch.Tensor:
        bits = torch.full((positions, self.words), -1, dtype=torch.int32)  # -1: everything (unused rows)
        consumed = 0
        try:
            for j in range(positions):
                self._fill(self.matcher, bits, j)
                if j >= len(drafts):
                    break
                tok = drafts[j]
                word = int(bits[j, tok // 32])
                # A refused draft is rejected at j (probability 0); an EOS ends the row there. Either way
                # positions after j are never used. EOS is not fed to the matcher: it ends the row.
                if not (word >> (tok % 32)) & 1 or tok in self.eos_ids:
                    break
                if not self.matcher.consume_token(tok):
                    raise RuntimeError(f"grammar matcher refused an allowed token: {self.matcher.get_error()}")
                consumed += 1
        finally:
            if consumed:
                self.matcher.rollback(consumed)
        return ((bits[:, :, None] >> _SHIFTS) & 1).view(positions, -1)[:, : self.vocab_size].bool()

    def commit(self, tokens: list[int]) -> None:
        for tok in tokens:
            if tok in self.eos_ids:
                return  # the row ends here
            # Only a stop token let through where the grammar allowed nothing (RowProcessor._never_empty)
            # can be refused; the row ends with it, and a matcher in error allows nothing after.
            self.matcher.consume_token(tok)

    @property
    def done(self) -> bool:
        return bool(self.matcher.is_stopped())
