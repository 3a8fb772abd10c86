"""Docs that cannot rot: README.md and docs/*.md link only to files and headings that exist, show only command-line
flags that `hf-zero3-loader` has, keep the README short, and hold no history (fuzz-seed logs, "until <date>" notes,
work-item numbers). One subprocess asks the CLI for its help; nothing heavy is imported here."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

README_MAX_LINES = 300
COMMANDS = ("plan", "verify", "bench")
CODE_BLOCK = re.compile(r"^```.*?^```", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]+`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
HISTORY = {
    "a fuzz-seed log": re.compile(r"(?<![\w-])seeds? \d+", re.I),  # not a `--seed 1` option
    "a work-item number": re.compile(r"\bissues? #?\d+", re.I),
    "a dated repair note": re.compile(r"\buntil (?:\w+ )?20\d\d", re.I),
}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code (links there are not links)."""
    return INLINE_CODE.sub("", CODE_BLOCK.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())  # a link's text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors(path: Path) -> frozenset[str]:
    found, seen = set(), {}
    for line in CODE_BLOCK.sub("", path.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = _slug(match[1])
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(found)


def test_the_pages_exist():
    assert README.is_file()
    assert {p.name for p in DOCS} >= {"design.md", "api.md", "errors.md", "benchmarks.md", "testing.md",
                                       "compatibility.md"}


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve(page: Path):
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:: not ours to check here
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {_rel(resolved)}")
    assert not broken, f"{_rel(page)}: " + "; ".join(broken)


def test_the_readme_stays_short():
    lines = len(README.read_text().splitlines())
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; keep it under {README_MAX_LINES} (move detail to docs/)"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_no_history(page: Path):
    text = page.read_text()
    found = [f"{what}: {m[0]!r}" for what, pattern in HISTORY.items() for m in pattern.finditer(text)]
    assert not found, f"{_rel(page)} holds history (git keeps it; user-visible changes go in CHANGELOG.md): {found}"


@functools.lru_cache(maxsize=None)
def cli_help() -> dict[str, str]:
    """`hf-zero3-loader [COMMAND] --help` for the top level and each command, and `--version`: one interpreter."""
    script = (
        "import contextlib, io, sys\n"
        "from hf_zero3_loader.cli import main\n"
        "for argv in ([], ['plan'], ['verify'], ['bench'], ['digest'], ['version']):\n"
        "    out = io.StringIO()\n"
        "    args = ['--version'] if argv == ['version'] else [*argv, '--help']\n"
        "    with contextlib.redirect_stdout(out):\n"
        "        try:\n"
        "            main(args)\n"
        "        except SystemExit:\n"
        "            pass\n"
        "    sys.stderr.write('=== ' + ' '.join(argv) + '\\n' + out.getvalue())\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    parts = re.split(r"^=== ?(.*)$", done.stderr, flags=re.M)
    return {name.strip(): body for name, body in zip(parts[1::2], parts[2::2])}


def _flags_shown() -> list[tuple[str, str, str]]:
    """(page, command, flag) for every flag shown after `hf-zero3-loader [command]` on one line of a code block or in
    one inline code span, and for every inline code span of the README's "Command line" section that starts with a
    flag (one of `plan`'s or `verify`'s)."""
    shown = []
    for page in PAGES:
        text = page.read_text()
        spans = [line for block in CODE_BLOCK.findall(text) for line in block.splitlines()]
        spans += [span.strip("`") for span in INLINE_CODE.findall(CODE_BLOCK.sub("", text))]
        for span in spans:
            for match in re.finditer(r"hf-zero3-loader(?:\s+(plan|verify|bench|digest)\b)?([^|#]*)", span):
                command = match[1] or ""
                shown += [(_rel(page), command, flag) for flag in FLAG.findall(match[2])]
    section = re.search(r"^## Command line$(.*?)^## ", README.read_text(), re.S | re.M)
    if section:
        for span in INLINE_CODE.findall(CODE_BLOCK.sub("", section[1])):
            if span.startswith("`--"):  # a flag of the commands the section describes, not another tool's
                shown += [("README.md", "plan|verify", flag) for flag in FLAG.findall(span)]
    return shown


def test_the_docs_show_command_lines():
    commands = {command for _, command, _ in _flags_shown()}
    assert {"plan", "verify", "plan|verify"} <= commands, commands


def test_every_flag_shown_exists():
    helps = cli_help()
    bench_flags = set(FLAG.findall((ROOT / "scripts" / "bench_load.py").read_text()))  # `bench` passes them through
    missing = []
    for page, command, flag in _flags_shown():
        if command == "bench":
            ok = flag in bench_flags
        elif command == "plan|verify":
            ok = any(re.search(rf"(?<![\w-]){flag}(?![\w-])", helps[c]) for c in ("plan", "verify"))
        else:
            ok = re.search(rf"(?<![\w-]){flag}(?![\w-])", helps[command]) is not None
        if not ok:
            missing.append(f"{page}: hf-zero3-loader {command} {flag}")
    assert not missing, "flags the docs show that the command line does not have: " + ", ".join(missing)


def test_version_is_the_package_version():
    version = re.search(r'__version__ = "([^"]+)"', (ROOT / "hf_zero3_loader" / "_version.py").read_text())[1]
    assert cli_help()["version"].strip() == f"hf-zero3-loader {version}"
