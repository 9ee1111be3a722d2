"""An agent's loop over source files, for instruct models: the `agentic` workload of
benchmarks/spec_decode.py, shaped like SuffixDecoding's agentic traces.

A session is an agent editing one part of a file (a run of whole top-level functions and classes)
over several turns. Each turn's prompt, through the chat template, holds a system line, the part as
it stands now, and an instruction of the kind an agent sends: rename an identifier, apply a given
edit, print the file. The edit is applied here, exactly (what a correct model writes and the agent's
tool saves), so the next turn's prompt holds the part as edited: the model re-reads what it wrote
the turn before and re-emits most of it again. Nothing depends on what the model actually answers,
so the prompts are the same for every method and deterministic by seed.

Torch-free: the caller passes the source texts (the benchmark: held-out stdlib files).
"""

from __future__ import annotations

import ast
import builtins
import io
import keyword
import random
import tokenize
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class AgenticConfig:
    """The workload's shape; the defaults keep a turn (prompt plus an answer re-emitting the part)
    under ~1.6k tokens, well inside SmolLM2's 8k context and the benchmark's KV budget."""

    turns_per_session: int = 4  # turns over one part of one file
    # The part of the file each session edits, in the model's tokens: long enough that re-emitting
    # it is most of an answer (agentic copies are tens to hundreds of tokens), short enough that a
    # 135M model still copies it rather than summarizing.
    min_part_tokens: int = 300
    max_part_tokens: int = 600
    system: str = (
        "You are a coding agent editing the file `{path}`. Always reply with the complete updated "
        "code in one ```python block."
    )


# Names a rename gives an identifier (the first not already in the part).
_NEW_NAMES = ("data", "value", "item", "result", "entry", "node", "buf", "obj", "target", "spec")
# Turn kinds, in the order a session's turns cycle through them from a seeded start: all ask for
# the whole code back, which is what an agent's edit loop asks of the model.
_KINDS = ("rename", "insert", "replace", "show")


@dataclass(frozen=True, slots=True)
class AgenticTurn:
    session: int
    turn: int
    kind: str
    messages: list[dict[str, str]]
    part_tokens: int  # the part's tokens as the prompt shows it (an answer re-emits about this many)


def _units(text: str) -> list[tuple[int, int]]:
    """Top-level functions and classes as (first line, last line), 1-based, decorators included."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    out = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.end_lineno:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            out.append((start, node.end_lineno))
    return out


def file_parts(text: str, count: Any, lo: int, hi: int) -> list[str]:
    """Runs of consecutive top-level units whose text is `lo`..`hi` tokens (`count(text)`), each the
    shortest run from its first unit that reaches `lo`."""
    return [part for _, _, part in _part_spans(text, count, lo, hi)]


def _part_spans(text: str, count: Any, lo: int, hi: int) -> list[tuple[int, int, str]]:
    """`file_parts` with each part's first and last line (1-based)."""
    lines = text.splitlines(keepends=True)
    units = _units(text)
    parts = []
    for i in range(len(units)):
        for j in range(i, len(units)):
            part = "".join(lines[units[i][0] - 1 : units[j][1]]).rstrip("\n") + "\n"
            n = count(part)
            if n > hi:
                break
            if n >= lo:
                parts.append((units[i][0], units[j][1], part))
                break
    return parts


def _name_tokens(code: str) -> list[tokenize.TokenInfo]:
    """NAME tokens that are identifiers (not keywords, not attributes after a dot)."""
    toks = list(tokenize.generate_tokens(io.StringIO(code).readline))
    out = []
    for prev, tok in zip([None, *toks[:-1]], toks):
        after_dot = prev is not None and prev.type == tokenize.OP and prev.string == "."
        if tok.type == tokenize.NAME and not keyword.iskeyword(tok.string) and not after_dot:
            out.append(tok)
    return out


def rename(code: str, old: str, new: str) -> str:
    """`old` renamed to `new` wherever it is an identifier (attributes after a dot untouched)."""
    lines = code.splitlines(keepends=True)
    for tok in reversed([t for t in _name_tokens(code) if t.string == old]):
        (row, col), (_, end) = tok.start, tok.end
        lines[row - 1] = lines[row - 1][:col] + new + lines[row - 1][end:]
    return "".join(lines)


def _rename_candidates(code: str) -> list[str]:
    """Parameters, assigned locals and defined functions used at least twice: what an agent renames."""
    tree = ast.parse(code)
    defined: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.arg):
            defined.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("__"):
            defined.add(node.name)
    names = [t.string for t in _name_tokens(code)]
    skip = {"self", "cls"} | set(dir(builtins))
    return sorted(n for n in defined if len(n) >= 3 and n not in skip and names.count(n) >= 2)


def _edit(code: str, kind: str, rng: random.Random) -> tuple[str, str, str]:
    """(kind, instruction, the code after it) for one turn of this kind; "show" when the kind finds
    nothing to edit."""
    lines = code.splitlines(keepends=True)
    if kind == "rename":
        cands = _rename_candidates(code)
        if cands:
            old = rng.choice(cands)
            present = {t.string for t in _name_tokens(code)}
            new = next((n for n in _NEW_NAMES if n not in present), old + "_")
            return (
                kind,
                f"Rename `{old}` to `{new}` everywhere in this code and return the whole code.",
                rename(code, old, new),
            )
    elif kind == "insert":
        defs = [i for i, s in enumerate(lines) if s.lstrip().startswith(("def ", "class "))]
        if defs:
            i = rng.choice(defs)
            indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
            comment = f"{indent}# Reviewed: keep the behaviour of this {lines[i].split()[0]} unchanged.\n"
            return (
                kind,
                f"Apply this edit and print the whole code: insert the line `{comment.strip()}` "
                f"right before the line `{lines[i].strip()}`.",
                "".join([*lines[:i], comment, *lines[i:]]),
            )
    elif kind == "replace":
        rets = [i for i, s in enumerate(lines) if s.lstrip().startswith("return ") and s.rstrip().endswith(
            tuple("abcdefghijklmnopqrstuvwxyz0123456789)]}_'\"")
        )]
        if rets:
            i = rng.choice(rets)
            indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
            value = lines[i].strip().removeprefix("return ")
            two = [f"{indent}result = {value}\n", f"{indent}return result\n"]
            return (
                kind,
                f"Apply this edit and print the whole code: replace the line `{lines[i].strip()}` with "
                f"the two lines `result = {value}` and `return result`.",
                "".join([*lines[:i], *two, *lines[i + 1 :]]),
            )
    return ("show", "Print the whole code as it is now, unchanged.", code)


def _session_rng(seed: int, session: int) -> random.Random:
    """Each session's own draws, so the first sessions are the same whatever the number of turns."""
    return random.Random(seed * 1_000_003 + session)


def agentic_turns(
    sources: list[tuple[str, str]], tokenizer: Any, n: int, seed: int, config: AgenticConfig = AgenticConfig()
) -> list[AgenticTurn]:
    """`n` turns of ceil(n / turns_per_session) sessions, each over a part of a different file (past
    the number of files, another part of one, sharing no line with its parts already taken), ordered turn by turn (every session's first turn, then every second...):
    sessions run side by side as concurrent agents, each one's turns in order.

    `sources`: (path shown to the model, text). Deterministic for the same sources, tokenizer and
    seed; fewer turns are a prefix of more turns' sessions."""
    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    rng = random.Random(seed)
    order = list(range(len(sources)))
    rng.shuffle(order)
    sessions: list[tuple[str, str]] = []
    num_sessions = -(-n // config.turns_per_session)
    # Lines of each file some session already edits: a file's next session takes a part sharing
    # none of them, since two sessions on one part would draft for each other as no two agents'
    # different tasks do.
    taken: dict[int, list[tuple[int, int]]] = {}
    spans: dict[int, list[tuple[int, int, str]]] = {}
    for idx in order * num_sessions:  # cycles through the files if there are more sessions
        if len(sessions) == num_sessions:
            break
        path, text = sources[idx]
        if idx not in spans:
            spans[idx] = _part_spans(text, count, config.min_part_tokens, config.max_part_tokens)
        used = taken.setdefault(idx, [])
        free = [p for p in spans[idx] if all(p[1] < a or p[0] > b for a, b in used)]
        if free:
            first, last, part = _session_rng(seed, len(sessions)).choice(free)
            used.append((first, last))
            sessions.append((path, part))
    if len(sessions) < num_sessions:
        raise ValueError(f"found parts for {len(sessions)} of {num_sessions} sessions in {len(sources)} sources")
    turns: list[list[AgenticTurn]] = []
    for s, (path, code) in enumerate(sessions):
        rng = _session_rng(seed, s)
        rng.random()  # not the part's draw again
        start = rng.randrange(len(_KINDS))
        mine = []
        for t in range(config.turns_per_session):
            kind, instruction, edited = _edit(code, _KINDS[(start + t) % len(_KINDS)], rng)
            user = f"Current contents of `{path}`:\n```python\n{code}```\n\n{instruction}"
            messages = [
                {"role": "system", "content": config.system.format(path=path)},
                {"role": "user", "content": user},
            ]
            mine.append(AgenticTurn(s, t, kind, messages, count(code)))
            code = edited
        turns.append(mine)
    flat = [turns[s][t] for t in range(config.turns_per_session) for s in range(len(turns))]
    return flat[:n]


def agentic_prompt_ids(tokenizer: Any, turns: list[AgenticTurn]) -> list[list[int]]:
    """Each turn through the tokenizer's chat template, ending where the assistant's answer starts."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("agentic chat prompts need a tokenizer with a chat template")
    out = []
    for turn in turns:
        text = tokenizer.apply_chat_template(turn.messages, tokenize=False, add_generation_prompt=True)
        out.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return out
