"""The documentation site: it builds strictly, its reference matches the code, its blocks parse.

`mkdocs build --strict` fails on a broken link or anchor, a page missing from the navigation or
a generated table whose source moved (docs/_hooks/generated.py). The rest compares the built
pages with what the code has: every command and option `rollouts --help` shows, every
environment variable the code reads, every failure class and kind it writes, every span and
metric it records.
"""

from __future__ import annotations

import ast
import html
import importlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docs_helpers import (
    DOCS,
    ROOT,
    SCREENSHOTS,
    SCREENSHOTS_DIR,
    SCREENSHOTS_RECORD,
    check_syntax,
    pages,
    screenshot_sources,
)

PRODUCT = ("schemas", "infra", "producer", "workers")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once for this module with `mkdocs build --strict`."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def page_text(site: Path, page: str) -> str:
    """The text of a built page's article, tags stripped."""
    raw = (site / page / "index.html").read_text()
    article = raw[raw.index("<article") : raw.index("</article>")]
    return html.unescape(re.sub(r"<[^>]+>", "", article))


def test_the_site_builds_strictly(site: Path) -> None:
    assert (site / "index.html").exists()
    assert (site / "reference" / "settings" / "index.html").exists()


def _help(*command: str) -> str:
    """What `rollouts COMMAND --help` prints (the console script's own click group, in-process)."""
    from click.testing import CliRunner

    from producer.cli import main

    done = CliRunner().invoke(main, [*command, "--help"], prog_name="rollouts", terminal_width=200)
    assert done.exit_code == 0, done.output
    return done.output


def _section(text: str, title: str) -> str:
    """The lines of a `--help` section (`Options:`, `Commands:`) up to the next blank line."""
    lines = text.splitlines()
    start = lines.index(title) + 1
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return "\n".join(lines[start:end])


def test_the_cli_reference_lists_every_command_and_option(site: Path) -> None:
    commands = [line.split()[0] for line in _section(_help(), "Commands:").splitlines()]
    assert len(commands) >= 10, commands
    text = page_text(site, "reference/cli")
    # Each command's part of the page: from its heading to the next command's.
    starts = {c: text.find(f"rollouts {c}¶") for c in commands}
    missing = [c for c, at in starts.items() if at < 0]
    assert not missing, f"commands missing from the CLI reference: {missing}"
    order = sorted(starts.values())
    for command in commands:
        at = starts[command]
        later = [s for s in order if s > at]
        part = text[at : later[0] if later else len(text)]
        options = set(
            re.findall(r"(?<![\w-])--?[A-Za-z][\w-]*", _section(_help(command), "Options:"))
        )
        absent = sorted(
            o for o in options if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", part)
        )
        assert not absent, f"rollouts {command}: options missing from the reference: {absent}"


def test_the_example_servers_page_has_every_flag(site: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "examples.servers", "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    flags = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", done.stdout)) - {"--help"}
    assert "--write-config" in flags
    text = page_text(site, "reference/example-servers")
    missing = sorted(f for f in flags if not re.search(rf"{f}(?![\w-])", text))
    assert not missing, f"flags of python -m examples.servers not on its page: {missing}"


def _product_sources() -> Iterator[Path]:
    for package in PRODUCT:
        yield from sorted((ROOT / package).rglob("*.py"))
    yield ROOT / "celeryconfig.py"


_VARIABLE = r"(?<=[\"'`])(?:ROLLOUTS|NEMO_GYM|OTEL|FLOWER|AWS|MALLOC|CELERY)_[A-Z0-9_]*[A-Z0-9]"
"""An environment variable's name as the code quotes it (`NEMO_GYM_DEFAULT_NAME` is a constant)."""


def test_every_environment_variable_the_code_reads_is_documented(site: Path) -> None:
    """Every variable name the product's code quotes is on the environment variables page."""
    names: set[str] = set()
    for path in _product_sources():
        names |= set(re.findall(_VARIABLE, path.read_text()))
    assert "ROLLOUTS_BROKER_URL" in names
    text = page_text(site, "reference/environment")
    missing = sorted(n for n in names if not re.search(rf"(?<![A-Z0-9_]){n}", text))
    assert not missing, f"environment variables the code reads, not documented: {missing}"


_FIELDS = {"FAILURE_CLASS": "_ng_failure_class", "FAILURE_KIND": "failure_kind"}
"""`schemas.fields` constants of the failure row's class and kind, and the fields they name."""


def _failure_vocabulary() -> dict[str, set[str]]:
    """Failure classes and failure kinds the product's code writes into failure rows."""
    found: dict[str, set[str]] = {"class": set(), "kind": set()}
    for path in _product_sources():
        tree = ast.parse(path.read_text())
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for node in ast.walk(tree):
            pairs: list[tuple[str, ast.expr]] = []
            if isinstance(node, ast.keyword) and node.arg in ("_ng_failure_class", "failure_kind"):
                pairs.append((node.arg, node.value))
            if isinstance(node, ast.Dict):
                for k, v in zip(node.keys, node.values, strict=True):
                    if isinstance(k, ast.Attribute) and k.attr in _FIELDS:
                        pairs.append((_FIELDS[k.attr], v))
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.targets[0], ast.Tuple)
                and isinstance(node.value, ast.Tuple)
            ):
                for target, value in zip(node.targets[0].elts, node.value.elts, strict=False):
                    if isinstance(target, ast.Name) and target.id == "kind":
                        pairs.append(("failure_kind", value))
            for name, value in pairs:
                bucket = found["class" if name == "_ng_failure_class" else "kind"]
                for leaf in ast.walk(value):
                    if isinstance(leaf, ast.Constant) and isinstance(leaf.value, str):
                        bucket.add(leaf.value)
                    elif isinstance(leaf, ast.Name) and leaf.id.isupper():
                        constant = getattr(importlib.import_module(module), leaf.id, None)
                        if isinstance(constant, str):
                            bucket.add(constant)
    return found


def test_every_failure_class_and_kind_the_code_writes_is_documented(site: Path) -> None:
    vocabulary = _failure_vocabulary()
    assert {"agent_run_error", "agent_request_failed", "worker_lost"} <= vocabulary["class"]
    assert "transport_timeout" in vocabulary["kind"]
    text = page_text(site, "reference/failures")
    missing = sorted(
        f"{what} {name}"
        for what, names in vocabulary.items()
        for name in names
        if not re.search(rf"(?<![\w:]){re.escape(name)}(?![\w:])", text)
    )
    assert not missing, f"written by the code, not on the failures page: {missing}"


def test_every_span_metric_and_attribute_name_is_documented(site: Path) -> None:
    names: set[str] = set()
    for path in _product_sources():
        text = path.read_text()
        names |= set(re.findall(r"\bstep\(\"([a-z_.]+)\"", text))
        if path.name in ("tracing.py", "telemetry.py", "capture_proxy.py"):
            names |= set(re.findall(r"\"((?:rollouts|gym|nemo)\.[a-z_.]*[a-z_])\"", text))
    assert "rollouts.collect" in names
    text = page_text(site, "reference/telemetry")
    missing = sorted(n for n in names if not re.search(rf"(?<![\w.]){re.escape(n)}(?![\w])", text))
    assert not missing, f"span, metric or attribute names not on the telemetry page: {missing}"


def test_every_block_of_every_page_parses() -> None:
    checked = 0
    problems = []
    for page in pages():
        for snippet in page.snippets:
            why = check_syntax(snippet)
            checked += 1
            if why:
                problems.append(f"{snippet.where} ({snippet.lang}): {why}")
    assert checked > 50
    assert not problems, "\n".join(problems)


def test_the_readme_is_short_and_its_ci_command_is_what_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert not re.search(r"(?i)\bissue \d+|SPEC", readme)
    ci = (ROOT / ".ci" / "run").read_text().replace("pip install -q ", "pip install ")
    blocks = [s for s in pages()[0].snippets if s.lang == "bash"]
    assert blocks[1].text.strip() in ci, "README's second quick-start command is not .ci/run's"


def test_no_page_points_outside_the_repository() -> None:
    for page in pages():
        text = page.path.read_text()
        assert not re.search(r"SPEC|\.\./shared|/work/(?:shared|main|wt)", text), page.path


def test_the_screenshots_are_there_and_current() -> None:
    """Every screenshot the docs show was made by `pytest -m screenshots` from what is here now;
    a change to what one looks like (its sources in SCREENSHOTS) makes it stale."""
    from PIL import Image

    shown = set()
    for page in DOCS.rglob("*.md"):
        shown |= set(re.findall(r"assets/screenshots/([\w.-]+\.png)", page.read_text()))
    assert shown == set(SCREENSHOTS), "the docs show screenshots no test makes, or the reverse"
    record = json.loads(SCREENSHOTS_RECORD.read_text())
    for name in sorted(SCREENSHOTS):
        with Image.open(SCREENSHOTS_DIR / name) as image:
            assert image.format == "PNG" and image.width >= 600, name
        assert record.get(name) == screenshot_sources(name), (
            f"{name} is stale: {', '.join(SCREENSHOTS[name])} changed since it was made; "
            "run `.venv/bin/python -m pytest -m screenshots -n 0`, look at it, and commit it"
        )


def test_every_docs_page_the_code_cites_exists(site: Path) -> None:
    """Comments and docstrings cite the page that holds a rule (`docs/explanation/contract.md#failures`):
    the page, and the anchor, must exist."""
    cited: set[tuple[str, str]] = set()
    for path in [
        *_product_sources(),
        *sorted((ROOT / "tests").rglob("*.py")),
        *sorted((ROOT / "bench").rglob("*.py")),
    ]:
        for page, anchor in re.findall(r"\bdocs/([\w/-]+)\.md(?:#([\w-]+))?", path.read_text()):
            cited.add((page, anchor))
    missing = []
    for page, anchor in sorted(cited):
        built = site / page / "index.html"
        if page == "index":
            built = site / "index.html"
        if not built.exists():
            missing.append(f"docs/{page}.md")
        elif anchor and f'id="{anchor}"' not in built.read_text():
            missing.append(f"docs/{page}.md#{anchor}")
    assert not missing, f"cited in the code, not in the docs: {missing}"
