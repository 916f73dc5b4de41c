"""The docs are what the code does: their runnable blocks run, their links lead somewhere, and the
generated reference is what tools/gen_docs.py makes of the code now.

A fenced block whose info string is `bash runnable` or `python runnable` runs here, in a fresh
temporary folder, with this checkout first on PYTHONPATH (so `graphopt` and child processes
import this code); a bash block runs with `set -euo pipefail`. Mark only blocks that take
seconds: the whole file is meant to stay within about a minute.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUNNABLE = {"bash", "python"}
BLOCK_SECONDS = 180

FENCE = re.compile(r"^(`{3,}|~{3,})(.*)$")


def fenced_blocks(text: str) -> list[tuple[int, str, str]]:
    """(line number of the opening fence, info string, body) of each fenced block."""
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, info, start = match.group(1), match.group(2).strip(), i
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        blocks.append((start + 1, info, "\n".join(body) + "\n"))
        i += 1
    return blocks


def runnable_blocks() -> list[tuple[str, str, str]]:
    """(id, language, code) of every block marked runnable in README.md and docs/."""
    found = []
    for path in DOCS:
        for line, info, body in fenced_blocks(path.read_text()):
            words = info.split()
            if len(words) >= 2 and words[1] == "runnable":
                assert words[0] in RUNNABLE, f"{path.relative_to(ROOT)}:{line}: runnable {words[0]!r} (runs: {RUNNABLE})"
                found.append((f"{path.relative_to(ROOT)}:{line}", words[0], body))
    return found


def run_block(language: str, code: str, folder: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    # the console script of this interpreter's environment first: `graphopt` is the one pip installed
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if language == "bash":
        command = ["bash", "-c", "set -euo pipefail\n" + code]
    else:
        command = [sys.executable, "-c", code]
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=BLOCK_SECONDS)


BLOCKS = runnable_blocks()


def test_the_docs_have_runnable_blocks():
    languages = {language for _, language, _ in BLOCKS}
    assert len(BLOCKS) >= 3 and languages == RUNNABLE, [b[0] for b in BLOCKS]


@pytest.mark.parametrize("language, code", [b[1:] for b in BLOCKS], ids=[b[0] for b in BLOCKS])
def test_runnable_block_runs(language, code, tmp_path):
    done = run_block(language, code, tmp_path)
    assert done.returncode == 0, f"exit {done.returncode}\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"


@pytest.mark.parametrize("language, code", [("bash", "echo one\nfalse\necho two\n"),
                                            ("bash", "true | false | true\n"),
                                            ("python", "raise SystemExit('broken')\n")])
def test_a_broken_block_fails(language, code, tmp_path):
    """The runner itself: a failing line in the middle of a block fails the block."""
    assert run_block(language, code, tmp_path).returncode != 0


# -- links ----------------------------------------------------------------------------------------
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def prose(text: str) -> str:
    """The text outside fenced blocks and inline code (where a [..](..) is not a link)."""
    out, fenced = [], None
    for line in text.split("\n"):
        match = FENCE.match(line)
        if fenced is None and match:
            fenced = match.group(1)
        elif fenced is not None and line.startswith(fenced):
            fenced = None
        elif fenced is None:
            out.append(re.sub(r"`[^`]*`", "", line))
        else:
            out.append("")
    return "\n".join(out)


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings."""
    found = set()
    for line in prose(path.read_text()).split("\n"):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            title = re.sub(r"[^\w\- ]", "", match.group(1).replace("`", "").lower())
            found.add(title.replace(" ", "-"))
    return found


def broken_links(path: Path) -> list[str]:
    broken = []
    text = prose(path.read_text())
    for match in LINK.finditer(text):
        target = match.group(1)
        if re.match(r"[a-z]+:", target):      # http:, https:, mailto:
            continue
        line = text.count("\n", 0, match.start()) + 1
        file_part, _, anchor = target.partition("#")
        destination = (path.parent / file_part).resolve() if file_part else path
        if not destination.exists():
            broken.append(f"{path.relative_to(ROOT)}:{line}: {target} (no such file)")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{path.relative_to(ROOT)}:{line}: {target} (no heading #{anchor} there)")
    return broken


def test_every_relative_link_points_at_an_existing_file():
    broken = [b for path in DOCS for b in broken_links(path)]
    assert not broken, "\n".join(broken)


def test_the_link_check_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# A heading\n")
    page.write_text("[ok](there.md#a-heading) `[code](nowhere.md)`\n```\n[fenced](nowhere.md)\n```\n"
                    "[missing](nowhere.md) [bad anchor](there.md#nope)\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = broken_links(page)
    finally:
        ROOT = saved
    assert [b.split(": ", 1)[1] for b in found] == ["nowhere.md (no such file)", "there.md#nope (no heading #nope there)"]


# -- the generated reference ------------------------------------------------------------------------
def gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "tools" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_reference_is_current():
    stale = [str(path.relative_to(ROOT)) for path, text in gen_docs().render().items()
             if not path.exists() or path.read_text() != text]
    assert not stale, f"stale: {stale}; regenerate: python tools/gen_docs.py"


def test_the_generated_reference_names_every_option_and_flag():
    """An oracle apart from the generator: each OptimizeOptions field and each flag of
    `graphopt serve` (from the parser and the dataclass) appears in the committed files."""
    import dataclasses

    from graphopt.cli import build_parser
    from graphopt.options import OptimizeOptions
    options = (ROOT / "docs" / "reference" / "options.md").read_text()
    for f in dataclasses.fields(OptimizeOptions):
        assert f"| `{f.name}` |" in options, f.name
    server = (ROOT / "docs" / "reference" / "server.md").read_text()
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    for action in serve._actions:
        for flag in action.option_strings:
            if flag not in ("-h", "--help"):
                assert f"`{flag}" in server, flag
