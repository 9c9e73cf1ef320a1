"""Every example in README.md and docs/ runs, or says why not.

A fenced ```python block is executed: the runnable blocks of one page run in order as one script (so a later block
may use what an earlier one defined), after the page's hidden set-up, in a fresh process started in a scratch
folder with the repository importable (`devices=2` starts its second rank by re-running that script, as for a
user). A page's set-up is an HTML comment, invisible on the page:

    <!-- setup
    train_loader = ...   # Python run before the page's blocks
    -->

A block the tests do not run carries, on the line before its fence, `<!-- not run: <why> -->`. A ```bash block
either carries `<!-- run -->` (each line is run, in the scratch folder, `python` being this interpreter), or
`<!-- tested by: tests/<file>.py::<test> -->` naming the test that runs it at a tiny size, or `<!-- not run: <why> -->`.
"""

from __future__ import annotations

import os
import re
import runpy
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
FENCE = re.compile(r"^```(\w*)\s*$")
MARK = re.compile(r"^<!--\s*(not run|tested by|run)\s*(?::\s*(.*?))?\s*-->\s*$")


@dataclass
class Block:
    language: str
    code: str
    line: int
    mark: str | None  # "not run", "tested by", "run" or None
    reason: str


@dataclass
class Page:
    path: Path
    setup: str = ""
    blocks: list[Block] = field(default_factory=list)


def parse(path: Path) -> Page:
    page, lines, i = Page(path), path.read_text().splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if line.strip() == "<!-- setup":
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "-->")
            page.setup += textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n"
            i = end + 1
            continue
        fence = FENCE.match(line.strip())
        if fence:
            indent = len(line) - len(line.lstrip())
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            code = "\n".join(text[indent:] for text in lines[i + 1 : end])
            previous = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            mark = MARK.match(previous)
            page.blocks.append(
                Block(
                    fence.group(1), code, i + 1, mark.group(1) if mark else None, (mark.group(2) or "") if mark else ""
                )
            )
            i = end + 1
            continue
        i += 1
    return page


def where(page: Page, block: Block) -> str:
    return f"{page.path.relative_to(ROOT)}:{block.line}"


def _in_repo(word: str) -> str:
    """A script of the repository named by a relative path (examples/gpt.py), made absolute: commands run elsewhere."""
    return str(ROOT / word) if word.endswith(".py") and (ROOT / word).is_file() else word


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_block_is_run_or_says_why_not(path: Path):
    page = parse(path)
    for block in page.blocks:
        if block.language == "python":
            assert block.mark in (None, "not run"), f"{where(page, block)}: a python block runs, or is 'not run: why'"
        elif block.language in ("bash", "sh", "shell"):
            assert block.mark is not None, f"{where(page, block)}: mark this command: run / tested by / not run"
        if block.mark == "not run":
            assert block.reason, f"{where(page, block)}: 'not run' needs its reason"
        if block.mark == "tested by":
            file, _, test = block.reason.partition("::")
            assert test and re.search(rf"def {re.escape(test)}\b", (ROOT / file).read_text()), (
                f"{where(page, block)}: {block.reason} is not a test"
            )


RUNNABLE = [
    p for p in PAGES if any(b.mark is None and b.language == "python" or b.mark == "run" for b in parse(p).blocks)
]


def run_page_script(script: str, workdir: str) -> None:
    """A page's script as `python page.py` runs it in `workdir`, in this process or on a rank of the test pool: a
    `Trainer(devices=2)` in it finds the pool's process group, as the rank that `python page.py` starts would find
    its own."""
    before = os.getcwd()
    os.chdir(workdir)
    try:
        exec(compile(script, os.path.join(workdir, "page.py"), "exec"), {"__name__": "__main__"})
    finally:
        os.chdir(before)


def run_module(module: str, argv: list[str], workdir: Path) -> None:
    """`python -m module *argv` in `workdir`, run in this process as runpy runs it for `-m`."""
    before_argv, before_cwd = sys.argv, os.getcwd()
    sys.argv = [module, *argv]
    os.chdir(workdir)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit:
        assert exit.code in (None, 0), f"python -m {module} {shlex.join(argv)} exited with {exit.code}"
    finally:
        sys.argv = before_argv
        os.chdir(before_cwd)


@pytest.mark.parametrize("path", RUNNABLE, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_examples_of_a_page_run(path: Path, tmp_path: Path, rank_pool):
    page = parse(path)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    script = page.setup + "".join(
        f"\n# {where(page, b)}\n{b.code}\n" for b in page.blocks if b.language == "python" and b.mark is None
    )
    (tmp_path / "page.py").write_text(script)
    if "devices=2" in script:  # two ranks: the test ranks (started once) rather than two new interpreters
        rank_pool(2).run(run_page_script, script, str(tmp_path))
    elif script.strip() and "init_process_group" not in script and "os.environ" not in script:
        run_page_script(script, str(tmp_path))  # one process: this one, as the suite's one-rank tests run
    elif script.strip():  # it sets up torch.distributed or the environment itself: a process of its own
        done = subprocess.run(
            [sys.executable, "page.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, f"{path.name}'s blocks failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    for block in (b for b in page.blocks if b.mark == "run"):
        for command in (c for c in block.code.replace("\\\n", " ").splitlines() if c.strip()):
            words = shlex.split(command)
            if words[0] in ("python", "python3") and words[1] == "-m":  # in this process: no interpreter to start
                run_module(words[2], words[3:], tmp_path)
                continue
            words = [sys.executable if w in ("python", "python3", ".venv/bin/python") else _in_repo(w) for w in words]
            done = subprocess.run(words, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, f"{where(page, block)}: {command}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"


def test_the_readmes_links_lead_to_files():
    """README.md is read on GitHub, outside the site: its relative links must name files that exist."""
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text()):
        assert (ROOT / target).is_file(), f"README.md links to {target}, which is not there"
