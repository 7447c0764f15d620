"""Helpers for the documentation tests: the fenced snippets of README.md and docs/, and the site.

A page's shell and Python blocks are what a reader copies, so the tests run them: every block of
a page, in order, as one bash script in a fresh folder (a `cd` or a variable carries over to the
next block, as in a reader's terminal). Markers are HTML comments, invisible on the site:

    <!-- snippet: syntax-only (why) -->   on the line before a block: checked, not run
                                          (it needs a real cluster or cloud, or installs)
    <!-- snippet: file NAME -->           on the line before a block: written to NAME, for the
                                          blocks after it to use
    <!-- snippets: NEED, NEED -->         anywhere in a page: what the test provides first

Needs: `servers` (the example servers running, `servers.yaml` written in the folder), `redis`
(a private Redis, its URL in `ROLLOUTS_BROKER_URL`), `cluster` (that and one worker process on
it), `s3=BUCKET` (the moto S3 server, the AWS variables, and BUCKET created on it).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

SHELL = frozenset({"bash", "sh", "shell"})
PYTHON = frozenset({"python", "py"})
YAML = frozenset({"yaml", "yml"})
JSON = frozenset({"json", "jsonl"})

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_BLOCK_MARKER = re.compile(
    r"^\s*<!-- snippet: (?P<kind>syntax-only|file)(?: (?P<arg>[^>]*?))? -->\s*$"
)
_PAGE_MARKER = re.compile(r"<!-- snippets: (?P<needs>[^>]*?) -->")
KNOWN_NEEDS = ("servers", "redis", "cluster", "s3")


@dataclass(frozen=True)
class Snippet:
    """One fenced block of a page."""

    page: Path
    line: int
    """1-based line of its opening fence."""
    lang: str
    text: str
    syntax_only: bool = False
    file: str | None = None
    """Where a `file` block is written, relative to the page's folder."""

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def runs(self) -> bool:
        return not self.syntax_only and (self.file is not None or self.lang in SHELL | PYTHON)


@dataclass(frozen=True)
class Page:
    """A Markdown page, its blocks and what its runnable blocks need."""

    path: Path
    snippets: tuple[Snippet, ...]
    needs: dict[str, str] = field(default_factory=dict)
    """Need -> its argument (`s3=BUCKET`: the bucket), '' when it takes none."""

    @property
    def runnable(self) -> bool:
        return any(s.runs for s in self.snippets)


def pages() -> list[Page]:
    """README.md and every page under docs/, in a stable order."""
    paths = [ROOT / "README.md", *sorted(p for p in DOCS.rglob("*.md") if "_hooks" not in p.parts)]
    return [read_page(p) for p in paths]


def read_page(path: Path) -> Page:
    lines = path.read_text().splitlines()
    snippets: list[Snippet] = []
    needs: dict[str, str] = {}
    for found in _PAGE_MARKER.finditer(path.read_text()):
        for need in filter(None, (n.strip() for n in found["needs"].split(","))):
            name, _, arg = need.partition("=")
            if name not in KNOWN_NEEDS:
                raise ValueError(f"{path}: unknown snippet need {name!r} (known: {KNOWN_NEEDS})")
            needs[name] = arg
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        start, indent, fence = i, len(opening["indent"]), opening["fence"]
        lang = (opening["info"].strip().split() or [""])[0].lower()
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1
        marker = _BLOCK_MARKER.match(_previous_nonblank(lines, start))
        kind = marker["kind"] if marker else None
        arg = (marker["arg"] or "").strip() if marker else ""
        snippets.append(
            Snippet(
                page=path,
                line=start + 1,
                lang=lang,
                text="\n".join(body) + "\n",
                syntax_only=kind == "syntax-only",
                file=arg or None if kind == "file" else None,
            )
        )
    return Page(path, tuple(snippets), needs)


def _previous_nonblank(lines: list[str], index: int) -> str:
    for j in range(index - 1, -1, -1):
        if lines[j].strip():
            return lines[j]
    return ""


def check_syntax(snippet: Snippet) -> str | None:
    """Why the block does not parse in its language, or None."""
    lang = snippet.lang
    if lang in SHELL:
        done = subprocess.run(["bash", "-n"], input=snippet.text, capture_output=True, text=True)
        return done.stderr.strip() or None if done.returncode else None
    try:
        if lang in PYTHON:
            ast.parse(snippet.text, filename=snippet.where)
        elif lang in YAML:
            list(yaml.safe_load_all(snippet.text))
        elif lang in JSON:
            try:
                json.loads(snippet.text)
            except json.JSONDecodeError:
                for line in snippet.text.splitlines():
                    if line.strip():
                        json.loads(line)
    except (SyntaxError, yaml.YAMLError, json.JSONDecodeError) as exc:
        return str(exc)
    return None


def page_script(page: Page, scratch: Path) -> str:
    """The page's runnable blocks as one bash script; Python blocks go to files in `scratch`."""
    out = ["set -e"]
    for n, s in enumerate(page.snippets):
        if not s.runs:
            continue
        out.append(f"echo {shlex.quote('::: ' + s.where)} >&2")
        if s.file is not None:
            out.append(f"cat > {shlex.quote(s.file)} <<'SNIPPET_EOF'\n{s.text}SNIPPET_EOF")
        elif s.lang in PYTHON:
            script = scratch / f"block-{n}.py"
            script.write_text(s.text)
            out.append(f"python {shlex.quote(str(script))}")
        else:
            out.append(s.text)
    return "\n".join(out) + "\n"


SCREENSHOTS_DIR = DOCS / "assets" / "screenshots"
SCREENSHOTS_RECORD = SCREENSHOTS_DIR / "screenshots.json"
SCREENSHOTS: dict[str, tuple[str, ...]] = {
    "report.png": ("workers/report/page.py", "workers/report/sections.py", "workers/report/svg.py"),
    "status-watch.png": ("producer/ops/status.py",),
    "flower.png": ("workers/redispatch.py", "flower"),
}
"""Each screenshot the docs show, and what its look comes from: source files of this checkout, or
a package (its version). When one changes, the screenshot is stale (`pytest -m screenshots`)."""


def screenshot_sources(name: str) -> str:
    """A digest of what screenshot `name` looks like it does because of."""
    from importlib.metadata import version

    h = hashlib.sha256()
    for source in SCREENSHOTS[name]:
        path = ROOT / source
        h.update(source.encode() + b"\0")
        h.update(path.read_bytes() if path.suffix else version(source).encode())
    return h.hexdigest()


def chromium_path() -> str | None:
    """Debian's chromium (`.ci/run` installs it), never a browser playwright downloads."""
    found = shutil.which("chromium")
    if found is None and os.path.exists("/usr/bin/chromium"):
        found = "/usr/bin/chromium"
    return found
