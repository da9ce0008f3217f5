"""Constrained decoding with llguidance (docs/design.md §1.6).

`GrammarCompiler` wraps one served tokenizer; `json_schema`, `json_object` and `lark` turn a request
into a checked `Grammar` (ValueError naming the problem otherwise: the API answers 400). Each row gets
its own `GrammarMatcher`, which the row's `RowProcessor` asks for the allowed tokens at every verify
position: the matcher walks the row's drafts (mask after d1..dj for position j), stops at the first
draft the grammar refuses (that draft has target probability 0 under the mask, so it is rejected and
nothing after it is used) and rolls back to the committed prefix; `commit` then advances it by the
tokens the row actually kept.

Errors. A schema llguidance cannot enforce is refused at compile time (ValueError, whose message
speaks of the client's schema only, never of our Lark wrapper): that includes a schema no value
satisfies or whose forced prefix never ends (`{"$ref": "#"}`, a required property referring back to
its object), found by walking a fresh matcher's forced tokens. Satisfiable recursive schemas (a
tree of nodes, `"$ref": "#"` under an optional property) are enforced as written. A matcher can
still fail while generating (a resource limit, a token it refuses): it then records a client-safe
`error`, allows only EOS from there on, and the row must end as an error, never as a normal
completion (RowProcessor.grammar_error, which the engine reads after each commit).

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
import logging
import re
from typing import Any

import torch

log = logging.getLogger(__name__)

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
# Free text around tool calls (tool_choice "auto"): anything without the opening tag, so every
# `<tool_call>` the output holds is one the grammar enforced.
_FREE_TEXT = r"/(?s:.*)/ & ~/(?s:.*<tool_call>.*)/"
# The same text ended by the tag, as one lexeme: a free-text lexeme followed by a spelled-out tag
# would swallow "<tool_call" and then refuse ">" (the lexer is greedy and never backtracks).
_TEXT_AND_TAG = r"/(?s:.*)<tool_call>/ & ~/(?s:.*<tool_call>.*<tool_call>.*)/"
# Unpacks llguidance's bitmask (bit t % 32 of int32 word t // 32 is token t) by shifting every word
# 0..31 places: ~30 µs for a 49k vocabulary, 5x faster than a byte lookup table.
_SHIFTS = torch.arange(32, dtype=torch.int32)
# Walking the forced tokens of a fresh matcher a few rounds finds the schemas whose every output
# fails the same way (ff tokens come in one run; later rounds cover a mask computed after them).
_PROBE_ROUNDS = 4
# llguidance's own words for a resource limit (lexer fuel, Earley items, lexer states, grammar size).
_LIMIT_WORDS = ("fuel", "too many", "too big", "limit", "exceeded")
# What a message about a grammar of ours may give away: its Lark text, llguidance's wrapper
# keywords, our rule names. A reason containing any of them is dropped, not echoed.
_SOURCE_EXCERPT = re.compile(r"\n\s*\d+ \| ")
_INTERNAL = re.compile(
    r"%json|x-guidance|(?i:lark)|<state>|<grammar>|\b(start|answer|think|call|calls|body|tool_\d+|args_\d+)\b\s*:"
    r"|\b(THINK_TEXT|THINK_BODY|THINK_WS|TEXT|OPEN)\b",
)
REFUSED = "constrained decoding failed: the grammar refused a generated token"
UNFINISHED = (
    "constrained decoding failed: the output ended before the required format was complete "
    "(the other sampling settings left no token it allows)"
)
TOO_COMPLEX = "constrained decoding failed: the schema is too complex to enforce (a grammar resource limit was reached)"
MATCHER_FAILED = "constrained decoding failed: the grammar matcher stopped with an internal error"


class GrammarCompiler:
    """Grammars over one tokenizer; vocab_size is the target's (rows past the tokenizer are never allowed).

    limits: llguidance.LLParserLimits fields (lexer fuel, Earley items, lexer states, grammar size)
    for compiling and matching, llguidance's defaults otherwise; errors are never verbose (a verbose
    one holds the whole grammar and parser state)."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], limits: dict[str, Any] | None = None
    ) -> None:
        import llguidance
        import llguidance.hf

        self._llg = llguidance
        self.vocab_size = vocab_size
        self.eos_ids = frozenset(eos_token_ids)
        self.limits = llguidance.LLParserLimits(**{**(limits or {}), "verbose_errors": False})
        # ~1 s for a 150k vocabulary: build once per server.
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        # llguidance matches a tokenizer's added tokens (Qwen3's <think>, <tool_call>, ...) only by name
        # (`<think>` in Lark), never by their text: a tag that is one such token is written that way.
        added = set(tokenizer.get_added_vocab())
        tags = ("<think>", "</think>", "<tool_call>", "</tool_call>")
        self.tag = {t: t if t in added else json.dumps(t) for t in tags}

    def new_matcher(self, grammar: str) -> Any:
        """A fresh llguidance matcher on grammar (silent: failures are read with get_error())."""
        return self._llg.LLMatcher(self.tokenizer, grammar, limits=self.limits, log_level=0)

    def _problem(self, grammar: str) -> str | None:
        """Why grammar cannot be used (llguidance's words, possibly naming our wrapper), or None."""
        is_error, messages = self._llg.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer, limits=self.limits
        )
        return (messages[0] if messages else "invalid grammar") if is_error else None

    def _schema_problem(self, grammar: str) -> str | None:
        """Why one schema's grammar cannot be used, or None. It may compile yet match nothing (a bare
        `$ref` cycle) or force an output that never ends (a required property referring back to its
        object): every row would fail at its first tokens, so a fresh matcher walks the forced tokens
        (~1 ms; building the matcher also validates the grammar)."""
        matcher = self.new_matcher(grammar)
        if matcher.is_error():
            return matcher.get_error()
        for _ in range(_PROBE_ROUNDS):
            matcher.compute_bitmask()
            forced = [] if matcher.is_error() else matcher.compute_ff_tokens()
            if forced and not matcher.is_error():
                matcher.consume_tokens(forced)
            if matcher.is_error():
                log.info("schema refused by its probe: %s", matcher.get_error())
                if any(w in matcher.get_error().lower() for w in _LIMIT_WORDS):
                    return "every value it allows is too large to generate (a $ref cycle with no way out?)"
                return "no value satisfies it (a $ref cycle with nothing else to choose?)"
            if not forced:
                break
        return None

    def _checked(self, grammar: str) -> Grammar:
        problem = self._problem(grammar)
        if problem is not None:
            raise ValueError(_unsupported("the schema", problem))
        return Grammar(self, grammar)

    def _schema_rule(self, schema: Any, what: str = "the schema") -> str:
        """A Lark `%json` rule body for schema in the compact spelling, checked on its own first so
        that a problem is told in terms of the schema (what: how the message names it)."""
        if not isinstance(schema, dict):
            raise ValueError(f"{what} must be a JSON object")
        text = json.dumps({**schema, "x-guidance": JSON_OPTIONS})
        if len(text) > MAX_SCHEMA_CHARS:
            raise ValueError(f"{what} must be at most {MAX_SCHEMA_CHARS} characters as JSON")
        try:
            alone = self._llg.LLMatcher.grammar_from_json_schema(text)
        except ValueError as exc:  # not a JSON object after all (llguidance checks nothing else here)
            raise ValueError(_unsupported(what, str(exc))) from None
        problem = self._schema_problem(alone)
        if problem is not None:
            raise ValueError(_unsupported(what, problem))
        return "%json " + text

    def json_schema(self, schema: Any, think: str = "none") -> Grammar:
        """Output that validates against schema (after a thinking block, see THINK)."""
        answer = self._schema_rule(schema)
        return self.lark(f"start: {THINK[think]} answer\nanswer: {answer}\n{self._think_rule(think)}")

    def json_object(self, think: str = "none") -> Grammar:
        return self.json_schema({"type": "object"}, think)

    def tool_calls(self, tools: dict[str, Any], parallel: bool, think: str = "none") -> Grammar:
        """One Hermes/Qwen3 `<tool_call>` block (or several, one a line, when parallel) calling one of
        tools (name -> parameters schema, None: any object), as app/tool_parser.py reads them. Only
        EOS may follow the last call (with parallel=False, the one call)."""
        calls = 'call ("\\n" call)*' if parallel else "call"
        return self.lark(
            f"start: {THINK[think]} {calls}\n"
            f'call: {self.tag["<tool_call>"]} "\\n" body "\\n" {self.tag["</tool_call>"]}\n'
            f"{self._tool_rules(tools)}{self._think_rule(think)}"
        )

    def tool_calls_auto(self, tools: dict[str, Any], parallel: bool, think: str = "none") -> Grammar:
        """tool_choice "auto" with the calls enforced: free text (EOS allowed anywhere in it), but a
        `<tool_call>` opens a block that must be one of tools called as in `tool_calls`. With
        parallel, free text and further calls may follow a call; without, only EOS. The free text
        never holds the tag itself, spelled out or as its token: every call the output holds is an
        enforced one."""
        opening, tail = self.tag["<tool_call>"], f'"\\n" body "\\n" {self.tag["</tool_call>"]}'
        if opening == "<tool_call>":  # one token: the free text ends where it comes
            calls = f"TEXT (<tool_call> {tail} TEXT)*" if parallel else f"TEXT (<tool_call> {tail})?"
            lexemes = f"TEXT: {_FREE_TEXT}\n"
        else:
            calls = f"(OPEN {tail})* TEXT" if parallel else f"TEXT | OPEN {tail}"
            lexemes = f"TEXT: {_FREE_TEXT}\nOPEN: {_TEXT_AND_TAG}\n"
        return self.lark(
            f"start: {THINK[think]} calls\ncalls: {calls}\n{lexemes}{self._tool_rules(tools)}{self._think_rule(think)}"
        )

    def _tool_rules(self, tools: dict[str, Any]) -> str:
        """`body`: one call's JSON, `{"name": <a tool's name>, "arguments": <its parameters>}`. Each
        tool's arguments are a `%json` rule of their own, so that its `$ref`s ("#", "#/$defs/...")
        resolve against its parameters schema as the client wrote it (nested in one schema for the
        whole body, "#" would be the body)."""
        if not tools:
            raise ValueError("there is no tool to call")
        rules, options = [], []
        for i, (name, parameters) in enumerate(tools.items()):
            args = self._schema_rule(parameters or {"type": "object"}, f"the parameters of {name!r}")
            head = '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
            rules.append(f'tool_{i}: {json.dumps(head)} args_{i} "}}"\nargs_{i}: {args}\n')
            options.append(f"tool_{i}")
        return f"body: {' | '.join(options)}\n" + "".join(rules)

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


def _unsupported(what: str, message: str) -> str:
    """A client's message for llguidance's: its reason without our wrapper (the position in our Lark
    text, the text itself) or nothing of it where it still names something of ours."""
    reason = message.strip()
    reason = re.sub(r"^at \d+\(\d+\): ", "", reason)
    cut = reason.find("failed to compile JSON schema: ")
    if cut >= 0:
        reason = reason[cut + len("failed to compile JSON schema: ") :]
    excerpt = _SOURCE_EXCERPT.search(reason)
    if excerpt:
        reason = reason[: excerpt.start()]
    reason = reason.strip()
    verb = "are" if what.startswith("the parameters") else "is"
    if not reason or _INTERNAL.search(reason):
        return f"{what} {verb} not supported"
    return f"{what} {verb} not supported: {reason}"


def _client_error(message: str) -> str:
    """A client-safe grammar_error for a matcher's failure (llguidance's message goes to the log)."""
    low = message.lower()
    if any(w in low for w in _LIMIT_WORDS):
        return TOO_COMPLEX
    if "doesn't satisfy the grammar" in low:
        return REFUSED
    return MATCHER_FAILED


class Grammar:
    """A checked grammar; `matcher()` starts a row on it."""

    def __init__(self, compiler: GrammarCompiler, text: str) -> None:
        self.compiler = compiler
        self.text = text

    def matcher(self, stop_ids: frozenset[int] = frozenset()) -> GrammarMatcher:
        return GrammarMatcher(self.compiler, self.text, stop_ids)


class GrammarMatcher:
    """One row's position in its grammar (model.engine.logits_processors.Matcher).

    stop_ids: the tokens besides EOS that end the row (stop_token_ids); one the grammar refuses can
    only come where the grammar allowed nothing (RowProcessor._never_empty) and ends the row
    normally when the grammar was complete there.

    The contract on `error`: None while the committed output is one the grammar allows. It is set,
    once and for good, to a client-safe message when the row can no longer be a valid completion:
    a committed token the grammar refuses, an EOS or stop token before the grammar is complete, or
    llguidance failing at the committed prefix (a resource limit, an internal error). From then on
    `allowed` lets only EOS through, `commit` does nothing and `done` is False; whoever finishes the
    row must report it as an error (finish_reason "error"), never as a normal completion, even when
    the same commit ended it with EOS. A failure while walking drafts that were never committed
    sets nothing: the matcher is rebuilt from the committed tokens and those positions allow only
    EOS (the commit that follows decides whether ending there is valid)."""

    def __init__(self, compiler: GrammarCompiler, grammar: str, stop_ids: frozenset[int] = frozenset()) -> None:
        import llguidance.torch

        self._fill = llguidance.torch.fill_next_token_bitmask
        self.compiler = compiler
        self.grammar = grammar
        self.eos_ids = compiler.eos_ids
        self._eos = torch.tensor(sorted(t for t in compiler.eos_ids if t < compiler.vocab_size), dtype=torch.long)
        self.stop_ids = frozenset(stop_ids) - compiler.eos_ids
        self.vocab_size = compiler.vocab_size
        self.words = (self.vocab_size + 31) // 32
        self.error: str | None = None
        self.ended = False  # a stop token ended the row after a complete output
        self.history: list[int] = []  # the committed tokens the matcher consumed (to rebuild it)
        self.matcher = compiler.new_matcher(grammar)
        if self.matcher.is_error():  # the grammar was checked: only a changed limit or tokenizer gets here
            log.warning("grammar matcher failed to start: %s", self.matcher.get_error())
            raise ValueError("the schema is not supported (the grammar matcher could not start)")

    def _fail(self, message: str, client: str | None = None) -> None:
        if self.error is None:
            log.warning("constrained decoding failed: %s", message)
            self.error = client or _client_error(message)

    def _rebuild(self) -> None:
        """A matcher at the committed prefix, for one left in error by a draft (its rollback is refused)."""
        matcher = self.compiler.new_matcher(self.grammar)
        if not matcher.consume_tokens(self.history):
            self._fail(matcher.get_error())
        self.matcher = matcher

    def _fill_ok(self, bits: torch.Tensor, j: int) -> bool:
        try:
            self._fill(self.matcher, bits, j)
        except Exception as exc:  # an API-level failure of llguidance: the row cannot go on either way
            log.exception("grammar mask computation raised")
            self._fail(str(exc), MATCHER_FAILED)
            return False
        return not self.matcher.is_error()

    def allowed(self, drafts: list[int], positions: int) -> torch.Tensor:
        """Allowed tokens [positions, V] after the committed prefix plus drafts[:j], for each j. Never
        raises for the grammar's sake: positions where the matcher failed allow only EOS."""
        bits = torch.full((positions, self.words), -1, dtype=torch.int32)  # -1: everything (unused rows)
        failed_at = 0 if self.error is not None or self.ended else positions  # first EOS-only row
        consumed = 0
        if failed_at:
            for j in range(positions):
                if not self._fill_ok(bits, j):
                    failed_at = j
                    break
                if j >= len(drafts):
                    break
                tok = drafts[j]
                word = int(bits[j, tok // 32])
                # A refused draft is rejected at j (probability 0); an EOS ends the row there. Either way
                # positions after j are never used. EOS is not fed to the matcher: it ends the row.
                if not (word >> (tok % 32)) & 1 or tok in self.eos_ids:
                    break
                if not self.matcher.consume_token(tok):  # allowed yet refused: llguidance failed on it
                    failed_at = j + 1
                    break
                consumed += 1
            if failed_at < positions:
                if failed_at == 0:  # at the committed prefix itself: the row cannot go on
                    self._fail(self.matcher.get_error() or "mask computation failed")
                else:  # only along drafts: nothing committed is lost
                    log.info("grammar matcher failed on a draft: %s", self.matcher.get_error())
                    self._rebuild()
            elif consumed and not self.matcher.rollback(consumed):
                self._rebuild()
        allowed = ((bits[:, :, None] >> _SHIFTS) & 1).view(positions, -1)[:, : self.vocab_size].bool()
        if failed_at < positions:
            allowed[failed_at:] = False
            allowed[failed_at:, self._eos] = True
        return allowed

    def commit(self, tokens: list[int]) -> None:
        """Advance by the tokens the row kept; sets `error` when they cannot be a valid output."""
        for tok in tokens:
            if self.error is not None or self.ended:
                return
            if tok in self.eos_ids:
                # Not fed to the matcher: it ends the row (or, ignoring EOS, is not part of the output).
                # The mask allows it only where the grammar is complete; one let through where the
                # grammar allowed nothing (RowProcessor._never_empty) ends an incomplete output.
                if not self.matcher.is_accepting():
                    self._fail("EOS before the grammar was complete", UNFINISHED)
                continue
            complete = tok in self.stop_ids and self.matcher.is_accepting()
            if self.matcher.consume_token(tok):
                self.history.append(tok)
            elif complete:
                self.ended = True
            else:
                self._fail(self.matcher.get_error(), UNFINISHED if tok in self.stop_ids else None)

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (False once it failed)."""
        return self.ended or (self.error is None and bool(self.matcher.is_stopped()))
