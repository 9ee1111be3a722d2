"""The agentic workload for instruct models (tandem/loadgen/agentic.py): seeded, whole top-level
units cut to the token range, exact edits, and each session's next turn showing the code as the
previous turn's edit left it."""

from __future__ import annotations

import ast
import itertools
import sysconfig
from pathlib import Path

import pytest

from tandem.loadgen import agentic as ag


class WordTokenizer:
    """A tokenizer stand-in: one token per whitespace-separated word; a template that joins turns."""

    chat_template = "stub"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [hash(w) % 1000 for w in text.split()]

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool, add_generation_prompt: bool) -> str:
        return "".join(f"<{m['role']}> {m['content']} " for m in messages) + "<assistant>"


def sources() -> list[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    names = ["secrets.py", "sched.py", "traceback.py", "copyreg.py", "chunk.py", "tomllib/_re.py"]
    return [(n, (root / n).read_text(encoding="utf-8")) for n in names if (root / n).exists()]


def test_rename_touches_identifiers_only() -> None:
    code = "def f(nbytes):\n    x = obj.nbytes + nbytes  # nbytes\n    return f'{nbytes}', 'nbytes'\n"
    assert ag.rename(code, "nbytes", "size") == (
        "def f(size):\n    x = obj.nbytes + size  # nbytes\n    return f'{nbytes}', 'nbytes'\n"
    )


def test_parts_are_whole_units_in_the_token_range() -> None:
    tok = WordTokenizer()
    for _, text in sources():
        for part in ag.file_parts(text, lambda s: len(tok.encode(s)), 60, 200):
            assert 60 <= len(tok.encode(part)) <= 200
            # From a function or class to one, whole, with what lies between: it parses alone.
            body = ast.parse(part).body
            assert all(isinstance(n, (ast.FunctionDef, ast.ClassDef)) for n in (body[0], body[-1]))


def test_sessions_are_seeded_and_each_turn_shows_the_previous_edit() -> None:
    tok = WordTokenizer()
    cfg = ag.AgenticConfig(turns_per_session=4, min_part_tokens=60, max_part_tokens=200)
    turns = ag.agentic_turns(sources(), tok, 10, seed=1, config=cfg)
    assert len(turns) == 10
    assert [t.turn for t in turns] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]  # every session's turn t, then t + 1
    again = ag.agentic_turns(sources(), tok, 10, seed=1, config=cfg)
    assert [t.messages for t in turns] == [t.messages for t in again]
    assert [t.messages for t in ag.agentic_turns(sources(), tok, 10, seed=2, config=cfg)] != [
        t.messages for t in turns
    ]

    def code_of(turn: ag.AgenticTurn) -> str:
        return turn.messages[1]["content"].split("```python\n")[1].split("```")[0]

    by_session: dict[int, list[ag.AgenticTurn]] = {}
    for t in turns:
        by_session.setdefault(t.session, []).append(t)
    kinds = set()
    for mine in by_session.values():
        for prev, nxt in itertools.pairwise(mine):
            kinds.add(prev.kind)
            before, after = code_of(prev), code_of(nxt)
            ast.parse(after)  # every edit leaves valid code
            instruction = prev.messages[1]["content"].rsplit("\n\n", 1)[1]
            if prev.kind == "show":
                assert after == before
            elif prev.kind == "rename":
                old, new = instruction.split("`")[1], instruction.split("`")[3]
                assert after == ag.rename(before, old, new) != before
            else:
                assert after != before and len(after.splitlines()) == len(before.splitlines()) + 1
    assert len(kinds) >= 3
    ids = ag.agentic_prompt_ids(tok, turns)
    assert all(len(p) <= 200 + 80 for p in ids)


def test_needs_a_chat_template() -> None:
    class Plain(WordTokenizer):
        chat_template = None

    turns = ag.agentic_turns(sources(), Plain(), 1, seed=0, config=ag.AgenticConfig(min_part_tokens=60))
    with pytest.raises(ValueError, match="chat template"):
        ag.agentic_prompt_ids(Plain(), turns)


def test_fewer_turns_are_the_first_sessions_of_more() -> None:
    tok = WordTokenizer()
    cfg = ag.AgenticConfig(turns_per_session=2, min_part_tokens=60, max_part_tokens=200)
    few = ag.agentic_turns(sources(), tok, 4, seed=3, config=cfg)
    many = ag.agentic_turns(sources(), tok, 8, seed=3, config=cfg)
    assert {(t.session, t.turn): t.messages for t in few}.items() <= {
        (t.session, t.turn): t.messages for t in many
    }.items()


def test_sessions_on_one_file_edit_parts_that_do_not_overlap() -> None:
    tok = WordTokenizer()
    cfg = ag.AgenticConfig(turns_per_session=1, min_part_tokens=60, max_part_tokens=200)
    turns = ag.agentic_turns(sources(), tok, 14, seed=0, config=cfg)
    by_path: dict[str, list[str]] = {}
    for t in turns:
        path = t.messages[0]["content"].split("`")[1]
        by_path.setdefault(path, []).append(t.messages[1]["content"].split("```python\n")[1].split("```")[0])
    assert any(len(parts) > 1 for parts in by_path.values())  # files were used again
    for parts in by_path.values():
        for i, a in enumerate(parts):
            for b in parts[i + 1 :]:
                assert a.splitlines()[0] not in b and b.splitlines()[0] not in a
