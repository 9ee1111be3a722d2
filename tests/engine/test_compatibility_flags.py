"""docs/compatibility.md's `vllm serve` flag table and the parser are one source: every row's flags
behave as its status says (supported: the parser has them; accepted, ignored: they parse, change
nothing and say so; not applicable: `tandem: error:` with the row's reason, exit 2), and the rows
that are not plain "supported" are exactly the table in tandem/entrypoints/vllm_flags.py."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.entrypoints.cli import build_parser, engine_kwargs

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs/compatibility.md"
IGNORED = "accepted, ignored"
NOT_APPLICABLE = "not applicable"
# Statuses of flags the parser implements itself (a row's notes say how).
SUPPORTED = {"supported", "supported for 1", "accepted (always on)"}


def page_rows() -> list[tuple[tuple[str, ...], str, str]]:
    """(flags, status, notes) of each row of the page's `vllm serve` flag table."""
    section = PAGE.read_text().split("## `vllm serve` flags", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| ") or line.startswith("| Flag "):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        assert len(cells) == 3, line
        flags = tuple(tok.split()[0] for tok in re.findall(r"`([^`]+)`", cells[0]) if tok.startswith("-"))
        rows.append((flags, cells[1], cells[2]))
    assert len(rows) > 30
    return rows


def flags_with(status: str | set[str]) -> list[str]:
    wanted = {status} if isinstance(status, str) else status
    return [flag for flags, s, _ in page_rows() if s in wanted for flag in flags]


def reason_of(flag: str) -> str:
    (notes,) = [n for flags, _, n in page_rows() if flag in flags]
    return notes.replace("`", "")


def serve_parser() -> argparse.ArgumentParser:
    return build_parser()._subparsers._group_actions[0].choices["serve"]


def an_instance(flag: str) -> str:
    """A concrete flag for a row's entry: a family (`--lora-*`) stands for any of its members."""
    if flag == "-O":
        return "-O3"
    return flag.replace("*", "x") if flag.endswith("*") else flag


def test_every_status_on_the_page_is_one_the_parser_knows():
    statuses = {s for _, s, _ in page_rows()}
    assert statuses <= SUPPORTED | {IGNORED, NOT_APPLICABLE}, statuses


def test_the_pages_ignored_and_not_applicable_rows_are_the_code_table():
    from tandem.entrypoints.vllm_flags import VLLM_FLAGS

    page = {(flags, s, notes) for flags, s, notes in page_rows() if s not in SUPPORTED}
    code = {(row.flags, row.status, row.reason) for row in VLLM_FLAGS}
    assert page == code


@pytest.mark.parametrize("flag", flags_with(SUPPORTED))
def test_supported_flags_are_the_parsers(flag):
    assert flag in serve_parser()._option_string_actions, flag


@pytest.mark.parametrize("flag", flags_with(IGNORED))
def test_ignored_flags_parse_change_nothing_and_say_so(flag, capsys):
    action = serve_parser()._option_string_actions[flag]
    value = [] if action.nargs == 0 else [{float: "0.5", int: "1"}.get(action.type, "x")]
    args = build_parser().parse_args(["serve", flag, *value])
    plain = build_parser().parse_args(["serve"])
    capsys.readouterr()
    assert engine_kwargs(args) == engine_kwargs(plain)
    err = capsys.readouterr().err
    assert f"tandem: note: {flag} is accepted and ignored: {reason_of(flag)}" in err, err
    engine_kwargs(plain)
    assert "ignored" not in capsys.readouterr().err


@pytest.mark.parametrize("flag", flags_with(NOT_APPLICABLE))
def test_not_applicable_flags_exit_with_the_pages_reason(flag, capsys):
    given = an_instance(flag)
    for argv in (["serve", given], ["serve", given, "4", "--port", "8001"], ["serve", f"{given}=4"]):
        if given.startswith("-O") and "=" in argv[1]:
            continue  # -O3 is already the attached form
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"tandem: error: {given} is not applicable in Tandem: {reason_of(flag)}" in err, err


def test_an_unlisted_flag_is_still_unknown(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--no-such-flag"])
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_the_command_line_gives_the_reason():
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.entrypoints.cli", "serve", "--cpu-offload-gb", "4"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("tandem: error: --cpu-offload-gb is not applicable in Tandem:"), proc.stderr
