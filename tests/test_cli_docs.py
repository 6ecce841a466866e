"""docs/cli.md, the flag reference, is exactly what `jaxspec COMMAND --help` prints for every command and action.

Regenerate it after changing a flag: `PYTHONPATH=. python tests/test_cli_docs.py` (from the repository root).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLI_DOC = REPO / "docs" / "cli.md"
COLUMNS = 100  # argparse wraps help to $COLUMNS: fixed, so the text does not depend on the terminal

HEADER = """# Command-line reference

Every `jaxspec` command and its flags, as `jaxspec COMMAND --help` prints them (wrapped at {columns} columns).
This page is generated from the parsers: `PYTHONPATH=. python tests/test_cli_docs.py` rewrites it, and
`tests/test_cli_docs.py` fails when it differs from the CLI. How the engine, policies and proposers behave:
[design.md](design.md); the figures: [benchmarks.md](benchmarks.md).
"""


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """`parser`'s sub-parsers by name, in the order they were added (aliases not repeated)."""
    for action in parser._actions:  # argparse has no public accessor for its sub-parsers
        if isinstance(action, argparse._SubParsersAction):
            seen, out = set(), {}
            for name, sub in action.choices.items():
                if id(sub) not in seen:
                    seen.add(id(sub))
                    out[name] = sub
            return out
    return {}


def _help_pages(parser: argparse.ArgumentParser) -> list[tuple[str, str]]:
    """(prog, help text) for `parser` and every sub-parser below it, depth first."""
    pages = [(parser.prog, parser.format_help())]
    for sub in _subcommands(parser).values():
        pages += _help_pages(sub)
    return pages


def cli_reference() -> str:
    """The text of docs/cli.md: every parser's --help, formatted at COLUMNS columns."""
    from jaxspec.cli import build_parser

    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(COLUMNS)
    try:
        pages = _help_pages(build_parser())
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved
    parts = [HEADER.format(columns=COLUMNS)]
    for prog, text in pages:
        parts.append(f"## `{prog}`\n\n```text\n{text.rstrip()}\n```\n")
    return "\n".join(parts)


def test_cli_doc_equals_the_help_of_every_command():
    expected = cli_reference()
    assert CLI_DOC.exists(), "docs/cli.md is missing: run `PYTHONPATH=. python tests/test_cli_docs.py`"
    assert CLI_DOC.read_text(encoding="utf-8") == expected, (
        "docs/cli.md differs from `jaxspec COMMAND --help`: run `PYTHONPATH=. python tests/test_cli_docs.py`")


def test_cli_doc_covers_every_command():
    from jaxspec.cli import COMMANDS

    text = cli_reference()
    for name in COMMANDS:
        assert f"## `jaxspec {name}`\n" in text, name
    assert "## `jaxspec models convert`\n" in text  # actions of a command are documented too


if __name__ == "__main__":
    CLI_DOC.write_text(cli_reference(), encoding="utf-8")
    print(f"wrote {CLI_DOC.relative_to(REPO)}", file=sys.stderr)
