"""The docs stay true: generated tables match the code, commands named in docs exist."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from kvtier.cli.main import build_parser
from kvtier.server.config import field_table_markdown

ROOT = Path(__file__).resolve().parents[3]


def test_operations_config_table_is_the_schema():
    doc = (ROOT / "docs/operations.md").read_text()
    m = re.search(r"<!-- config-table:begin -->\n(.*?)\n<!-- config-table:end -->", doc, re.S)
    assert m, "config table markers missing"
    assert m.group(1).strip() == field_table_markdown().strip()


def test_readme_quick_start_is_exactly_two_commands():
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"## Quick start\s*\n+```\n(.*?)```", readme, re.S)
    assert m and m.group(1).split("\n")[:-1] == ["make run", "make test"]
    for link in re.findall(r"\]\((docs/[^)]+)\)", readme):
        assert (ROOT / link).exists(), link


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def test_every_kvtier_command_in_the_docs_exists():
    top = _subcommands(build_parser(load_all=True))
    seen = 0
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        code = re.findall(r"```[a-z]*\n(.*?)```", text, re.S) + re.findall(r"`([^`\n]+)`", text)
        for line in "\n".join(code).splitlines():
            m = re.match(r"^\s*(?:\$ )?kvtier ([a-z][a-z0-9-]*)(?: ([a-z][a-z0-9-]*))?", line)
            if not m:
                continue
            seen += 1
            cmd, sub = m.groups()
            assert cmd in top, f"{path.name}: unknown command `kvtier {cmd}`"
            subs = _subcommands(top[cmd])
            if subs and sub is not None:
                assert sub in subs, f"{path.name}: unknown command `kvtier {cmd} {sub}`"
    assert seen >= 10


def test_benchmarks_page_is_short_and_holds_no_unrecorded_figures():
    """A page a user can read: under 400 lines; its summary comes from benchmarks/results/
    (tests/unit/benchmarks/test_results.py); nothing measured by a script that was not committed."""
    text = (ROOT / "docs/benchmarks.md").read_text()
    assert len(text.splitlines()) < 400
    assert "scratch" not in text.lower()
    assert "<!-- results:begin -->" in text and "<!-- results:end -->" in text
