"""The repository reads as a product, not a lab notebook, and every figure keeps a path to its raw output.

- No work-log language in tracked files: the word "session" (and "closing note") nowhere but where
  :data:`WORK_LOG_ALLOWED` says why.
- Every ``results/<date>-...`` path a tracked file outside ``results/`` names exists, and every folder under
  ``results/`` is named by one of them and holds a README.md (the command that made its output).
- Every relative link in the tracked Markdown resolves: the file exists and, for ``#anchor``, the heading does
  (GitHub's anchors); so does every ``docs/*.md#anchor`` a non-Markdown file names (the packaged YAML's).
- The size budgets of issue 50: README, docs, ``results/``, the packaged YAML.

The tracked files come from ``git ls-files``; without git or outside a checkout the tests skip.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: tracked files that may contain the work-log words, each with its reason
WORK_LOG_ALLOWED = {
    "tests/test_repo_hygiene.py": "this test names the words it looks for",
}
WORK_LOG = re.compile(r"session|closing[ -]note", re.IGNORECASE)

#: a run's folder under results/: named by date, then GPU and what it measured
RESULTS_PATH = re.compile(r"results/(\d{4}-\d{2}-\d{2}-[\w.-]+)((?:/[\w.-]+)*/?)")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")
DOC_ANCHOR = re.compile(r"\b((?:docs/)?[\w-]+\.md)#([\w-]+)")

README_MAX_CHARS = 6000
DOCS_MAX_BYTES = 120_000  # docs/*.md and benchmarks/README.md: the 120 KB
RESULTS_MAX_FILES = 120
RESULTS_MAX_BYTES = 3 * 1024**2
PACKAGED_YAML_MAX_LINES = 120


@cache
def tracked() -> tuple[str, ...]:
    """The repository's tracked files (paths relative to the root); the test skips without git or a checkout."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed: the tracked files cannot be listed")
    done = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"not a git checkout: {done.stderr.decode(errors='replace').strip()}")
    return tuple(name for name in done.stdout.decode().split("\0") if name and (ROOT / name).is_file())


def text(name: str) -> str | None:
    """A tracked file's text, or None for a binary one."""
    try:
        return (ROOT / name).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def outside_results() -> list[str]:
    return [name for name in tracked() if not name.startswith("results/")]


def markdown_lines(body: str):
    """(line number, line) of a Markdown text outside its fenced code blocks."""
    fence = None
    for number, line in enumerate(body.splitlines(), start=1):
        stripped = line.lstrip()
        if fence is None and stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
        elif fence is not None and stripped.startswith(fence):
            fence = None
        elif fence is None:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation (`, :, ., ×, ...) dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """The anchors of a Markdown file's headings, repeated ones numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in markdown_lines(path.read_text(encoding="utf-8")):
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = slug(heading.group(1))
            found.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return frozenset(found)


def test_slug_follows_github():
    # independent reference: the anchors GitHub renders for these headings
    assert slug("H200: speed and memory") == "h200-speed-and-memory"
    assert slug("H200: torch.compile") == "h200-torchcompile"
    assert slug("Gradient errors (`gpu-tests-final.jsonl`)") == "gradient-errors-gpu-tests-finaljsonl"
    assert slug("One call: `apply_flce`") == "one-call-apply_flce"


def test_no_work_log_language_in_tracked_files():
    found = []
    for name in tracked():
        if name in WORK_LOG_ALLOWED:
            continue
        if WORK_LOG.search(name):
            found.append(f"{name}: in its path")
        for number, line in enumerate((text(name) or "").splitlines(), start=1):
            if WORK_LOG.search(line):
                found.append(f"{name}:{number}: {line.strip()[:120]}")
    assert not found, "work-log language (say what was measured and when, by date):\n" + "\n".join(found)


def test_every_allowed_work_log_entry_is_still_needed():
    for name, reason in WORK_LOG_ALLOWED.items():
        assert reason and name in tracked(), f"{name}: not tracked, drop it from WORK_LOG_ALLOWED"
        assert WORK_LOG.search(text(name) or ""), f"{name}: no longer has the words, drop it from WORK_LOG_ALLOWED"


def cited_results() -> dict[str, list[str]]:
    """Every results/<run>... path named by a tracked file outside results/, with where it is named."""
    cited: dict[str, list[str]] = {}
    for name in outside_results():
        for number, line in enumerate((text(name) or "").splitlines(), start=1):
            for match in RESULTS_PATH.finditer(line):
                path = ("results/" + match.group(1) + match.group(2)).rstrip(".")
                cited.setdefault(path, []).append(f"{name}:{number}")
    return cited


def test_every_cited_results_path_exists():
    cited = cited_results()
    assert cited, "no results/ path found: the pattern no longer matches the docs"
    missing = [f"{path} (named at {', '.join(where)})" for path, where in cited.items() if not (ROOT / path).exists()]
    assert not missing, "cited but not in results/:\n" + "\n".join(missing)


def test_every_results_folder_is_cited_and_says_how_it_was_made():
    folders = {name.split("/")[1] for name in tracked() if name.startswith("results/") and name.count("/") >= 2}
    cited = {path.split("/")[1] for path in cited_results()}
    assert folders, "results/ holds no run"
    assert not folders - cited, f"folders under results/ that nothing outside results/ names: {sorted(folders - cited)}"
    without = sorted(f for f in folders if f"results/{f}/README.md" not in tracked())
    assert not without, f"folders without a README.md saying which command made their output: {without}"


def test_every_relative_markdown_link_resolves():
    broken = []
    for name in tracked():
        if not name.endswith(".md"):
            continue
        source = ROOT / name
        for number, line in markdown_lines(source.read_text(encoding="utf-8")):
            for target in MARKDOWN_LINK.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                resolved = (source.parent / path).resolve() if path else source
                if not resolved.exists():
                    broken.append(f"{name}:{number}: {target} (no such file)")
                elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                    broken.append(f"{name}:{number}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_docs_anchor_named_outside_markdown_resolves():
    broken = []
    for name in outside_results():
        if name.endswith(".md"):
            continue  # their links: the test above
        for number, line in enumerate((text(name) or "").splitlines(), start=1):
            for page, anchor in DOC_ANCHOR.findall(line):
                path = ROOT / page if "/" in page else ROOT / "docs" / page
                if not path.is_file() or anchor not in anchors(path):
                    broken.append(f"{name}:{number}: {page}#{anchor}")
    assert not broken, "anchors that name no heading:\n" + "\n".join(broken)


def test_the_packaged_yaml_links_each_entry_to_its_results_section():
    body = (ROOT / "configs" / "default.yaml").read_text(encoding="utf-8")
    entries = [line for line in body.splitlines() if line.lstrip().startswith("- ")]
    comments = [line for line in body.splitlines() if line.lstrip().startswith("#")]
    assert entries and any("docs/results.md#" in line for line in comments[:5]), "the header links the rule"
    for kind in ("measured", "derived"):
        assert any(kind in line and "docs/results.md#" in line for line in comments), f"no {kind} entry linked"


def test_size_budgets():
    tracked_results = [name for name in tracked() if name.startswith("results/")]
    docs = [ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    sizes = {
        "README.md characters": (len((ROOT / "README.md").read_text(encoding="utf-8")), README_MAX_CHARS),
        "docs/*.md + benchmarks/README.md bytes": (sum(p.stat().st_size for p in docs), DOCS_MAX_BYTES),
        "files under results/": (len(tracked_results), RESULTS_MAX_FILES),
        "bytes under results/": (sum((ROOT / n).stat().st_size for n in tracked_results), RESULTS_MAX_BYTES),
        "lines of configs/default.yaml": (
            len((ROOT / "configs" / "default.yaml").read_text(encoding="utf-8").splitlines()),
            PACKAGED_YAML_MAX_LINES,
        ),
    }
    over = {what: size for what, (size, limit) in sizes.items() if size > limit}
    assert not over, f"over budget: {over} (limits: { {w: limit for w, (_, limit) in sizes.items()} })"
