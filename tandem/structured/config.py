"""Bounds on structured output's grammar engine: where a spec is checked, how long and how deep it
may go, and how much memory compiled grammars may hold. Users set the two `EngineConfig` fields
(`structured_outputs_cache_bytes`, `structured_outputs_check_timeout_s`); the rest are the
values the measurements below justify."""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    # -- the check (tandem/structured/checker.py). llguidance's grammar compiler recurses on the
    # native stack once per nesting level (a chain of rules, nested `$ref`s): on an 8 MiB thread
    # stack a Lark chain of 3,000 rules (37 KB) overflows it and kills the process. Every spec is
    # therefore compiled first in a separate check process, on a thread with `check_stack_bytes`
    # of stack; a spec that crashes or outlasts `check_timeout_s` there is refused (HTTP 400) and
    # costs a new check process, nothing else.
    check_timeout_s: float = 5.0
    check_stack_bytes: int = 64 * MIB
    # The check process's address space (a compile that would take more is refused).
    check_memory_bytes: int = 4096 * MIB
    # Check processes run side by side (a slow spec holds one for at most `check_timeout_s`).
    check_processes: int = 2
    # Checked specs whose verdict is remembered (by digest), so a repeated schema is not sent again.
    check_verdicts: int = 512
    # How long a check process may take to start (import llguidance, read the tokenizer).
    check_start_timeout_s: float = 60.0
    # -- the engine's compile thread runs on `compile_stack_bytes` of stack: four times the check's,
    # so whatever passed the check compiles there with room to spare (the recursion is the same).
    compile_stack_bytes: int = 256 * MIB
    # -- the compiled-grammar cache is bounded by memory as well as by entries: a grammar is charged
    # `base_bytes + bytes_per_char * len(spec)`. Measured (benchmarks/reliability.py, the grammar
    # memory probe): JSON enums of 10k-60k values take 53-56 bytes a character of their schema
    # (6-40 MB each), a 2,000-property object 80, regexes and Lark grammars 3-20; a compiled
    # grammar's fixed part (its token trie view, lexer) is about 0.3-0.6 MB.
    bytes_per_char: int = 96
    base_bytes: int = 1 * MIB

    def grammar_bytes(self, spec_chars: int) -> int:
        """What a compiled grammar of a spec this long is charged against the cache's byte bound."""
        return self.base_bytes + self.bytes_per_char * spec_chars


DEFAULT_LIMITS = GrammarLimits()
