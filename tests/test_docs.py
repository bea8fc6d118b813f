"""The code blocks of README.md and docs/*.md run as written (CPU, Triton interpreter).

Each ```python block runs in a process of its own, in a fresh working directory, with
``TRITON_INTERPRET=1`` and no GPU visible. Each command of a ```bash / ```console block (in
```console, the lines after ``$ ``) must be a ``flce-policy`` command, ``NAME=value`` prefixes
allowed, no pipes or redirections; a block's commands run one after the other in one process,
through the installed ``flce-policy`` entry point (one process per block, not per command: CI's
time is short), from a working directory holding the file's ``file`` blocks. The processes are
forked from one that has imported torch, flce_policy and transformers already, with the blocks'
environment (tests/_warm_start.py: a start-up per test process, not per block); each starts from
a fresh ``__main__`` namespace, its own environment and the ``sys.path`` of ``python script.py``.
A failure names the Markdown file and the line of the block or command (python tracebacks point
into the Markdown file itself). Keep blocks tiny: the whole file runs in about half a minute on 2
CPU cores.

An HTML comment on the line(s) right above a fence, invisible once rendered, changes how it runs:

- ``<!-- docs-test: gpu-only, <reason> -->``: not run here (needs a GPU);
- ``<!-- docs-test: install, <reason> -->``: not run here; installs, which CI runs itself (.ci/run);
- ``<!-- docs-test: continues -->``: this python block runs after the file's previous python block, in
  the same interpreter (it uses what that one defined);
- ``<!-- docs-test: file <path> -->``: the block is the content of that file: written, not run, in the
  working directory of every block of the same Markdown file;
- ``<!-- docs-test: torchrun <n> -->``: this python block runs in <n> processes with the environment
  ``torchrun --standalone --nproc-per-node <n>`` gives them (RANK, WORLD_SIZE, MASTER_ADDR, ...).

Blocks of any other language (text, yaml without ``file``) are not run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import _warm_start
import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON = {"python", "py"}
SHELL = {"bash", "sh", "shell", "console"}
SKIP_KINDS = {"gpu-only", "install"}
TIMEOUT_S = 300  # one block (or chain); generous: a loaded 2-core machine runs the interpreter slowly

FENCE = re.compile(r"^(`{3,})\s*([\w+-]*)\s*$")
MARKER = re.compile(r"^<!--\s*docs-test:\s*(.*?)\s*-->$")
ENV_ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
SHELL_OPERATORS = {"|", "||", "&", "&&", ";", "<", ">", ">>", "2>", "2>&1"}

#: Runs the blocks of one chain in one namespace, each compiled under its Markdown file and line.
DRIVER = """\
import json, sys
namespace = {"__name__": "__main__"}
for block in json.load(open(sys.argv[1])):
    print(f"docs-test: running {block['where']}", file=sys.stderr, flush=True)
    exec(compile("\\n" * block["line"] + block["code"], block["path"], "exec"), namespace)
"""

#: Runs a shell block's flce-policy commands through the installed console-script entry point.
CLI_DRIVER = """\
import json, os, sys
from importlib.metadata import entry_points

sys.path[0] = os.path.dirname(sys.executable)  # as the installed script has it: its folder, not the working one
(script,) = entry_points(group="console_scripts", name="flce-policy")
main = script.load()
for where, env, args in json.load(open(sys.argv[1])):
    print(f"docs-test: running {where}: flce-policy {' '.join(args)}", file=sys.stderr, flush=True)
    for name, value in env.items():
        value = os.path.expandvars(value)
        os.environ[name] = value
        if name == "PYTHONPATH":  # read at start-up only: put it where a fresh process would have it
            sys.path[1:1] = [os.path.abspath(p) for p in value.split(os.pathsep)]
    sys.argv = ["flce-policy", *(os.path.expandvars(a) for a in args)]
    try:
        status = main()
    except SystemExit as exit_:
        status = exit_.code
    if status not in (0, None):
        print(f"docs-test: exit status {status}", file=sys.stderr, flush=True)
        sys.exit(1)
"""


@dataclass
class Block:
    path: Path
    line: int  # the opening fence's line, 1-based
    language: str
    code: str
    markers: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path}:{self.line}"

    def marker(self, kind: str) -> str | None:
        """The argument of this block's marker of that kind ('' if it has none), or None without one."""
        for text in self.markers:
            name, _, rest = text.partition(" ")
            name = name.rstrip(",")
            if name == kind:
                return rest.strip()
        return None


def parse(path: Path, text: str | None = None) -> list[Block]:
    """The fenced blocks of a Markdown file, each with the docs-test markers right above it."""
    lines = (path.read_text() if text is None else text).splitlines()
    blocks, pending, i = [], [], 0
    while i < len(lines):
        marker, fence = MARKER.match(lines[i].strip()), FENCE.match(lines[i])
        if marker:
            pending.append(marker.group(1))
        elif fence:
            ticks, language, start = fence.group(1), fence.group(2).lower(), i
            i += 1
            while i < len(lines) and lines[i].strip() != ticks:
                i += 1
            blocks.append(Block(path, start + 1, language, "\n".join(lines[start + 1 : i]) + "\n", pending))
            pending = []
        elif lines[i].strip():
            if pending:
                raise ValueError(f"{path}:{i + 1}: a docs-test marker must be right above a fence")
        i += 1
    return blocks


def check_markers(block: Block) -> None:
    for text in block.markers:
        name = text.partition(" ")[0].rstrip(",")
        if name not in {*SKIP_KINDS, "continues", "file", "torchrun"}:
            raise ValueError(f"{block.where}: unknown docs-test marker {text!r}")
        if name in SKIP_KINDS | {"file", "torchrun"} and not block.marker(name):
            raise ValueError(f"{block.where}: the docs-test marker {name!r} needs its argument (a reason, a path, n)")


@dataclass
class Unit:
    """What one test runs: a python chain, or one shell block; files are the doc's file-marked blocks."""

    blocks: list[Block]
    files: list[Block]

    @property
    def where(self) -> str:
        return self.blocks[0].where


def units(path: Path, text: str | None = None) -> list[Unit | Block]:
    """The runnable units of one Markdown file, and its skipped blocks (as Blocks)."""
    blocks = parse(path, text)
    for block in blocks:
        check_markers(block)
    files = [b for b in blocks if b.marker("file")]
    out: list[Unit | Block] = []
    last_python: Unit | None = None
    for block in blocks:
        if any(block.marker(kind) for kind in SKIP_KINDS):
            out.append(block)
        elif block.marker("file") or block.language not in PYTHON | SHELL:
            continue
        elif block.language in PYTHON and block.marker("continues") is not None:
            if last_python is None:
                raise ValueError(f"{block.where}: 'continues' with no python block before it")
            last_python.blocks.append(block)
        else:
            unit = Unit([block], files)
            out.append(unit)
            if block.language in PYTHON:
                last_python = unit
    return out


def _environment() -> dict[str, str]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("PYTHONPATH", None)  # a block sees what a user's fresh shell would: only what is installed
    return env


def _write_files(unit: Unit, workdir: Path) -> None:
    for block in unit.files:
        target = workdir / block.marker("file")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(block.code)


def _fail(where: str, what: str, status: int, output: str) -> None:
    pytest.fail(f"{where}: {what} (exit {status})\n{output[-6000:]}", pytrace=False)


def _torchrun_environments(ranks: int) -> list[dict[str, str]]:
    """What ``torchrun --standalone --nproc-per-node <ranks>`` gives each process (its launcher left out:
    one torch import less)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    group = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(ranks)}
    return [
        {**_environment(), **group, "LOCAL_WORLD_SIZE": str(ranks), "RANK": str(r), "LOCAL_RANK": str(r)}
        for r in range(ranks)
    ]


def run_python(unit: Unit, workdir: Path) -> None:
    chain = [{"where": b.where, "path": str(b.path), "line": b.line, "code": b.code} for b in unit.blocks]
    (workdir / "_docs_chain.json").write_text(json.dumps(chain))
    ranks = unit.blocks[0].marker("torchrun")
    environments = _torchrun_environments(int(ranks)) if ranks else [_environment()]
    logs = [workdir / f"_docs_process{i}.log" for i in range(len(environments))]
    argv = ["_docs_driver.py", "_docs_chain.json"]
    processes = [
        _warm_start.run_script(DRIVER, argv, str(workdir), env, str(log))
        for env, log in zip(environments, logs, strict=True)
    ]
    _wait(unit, processes)
    for rank, (process, log) in enumerate(zip(processes, logs, strict=True)):
        if process.exitcode != 0:
            output = log.read_text()
            started = re.findall(r"docs-test: running (\S+)", output)
            what = "this python block failed" + (f" on rank {rank}" if ranks else "")
            _fail(started[-1] if started else unit.where, what, process.exitcode, output)


def _wait(unit: Unit, processes: list) -> None:
    """Until every process of ``unit`` has ended; a failure naming the unit (and the processes killed) past
    TIMEOUT_S."""
    deadline = time.monotonic() + TIMEOUT_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    if any(process.is_alive() for process in processes):
        for process in processes:
            process.kill()
            process.join()
        pytest.fail(f"{unit.where}: still running after {TIMEOUT_S} s", pytrace=False)


def shell_commands(block: Block) -> list[tuple[int, dict[str, str], list[str]]]:
    """(Markdown line, NAME=value prefixes, arguments) of each flce-policy command of a bash/console block."""
    commands = []
    for number, raw in enumerate(block.code.splitlines(), start=block.line + 1):
        line = raw.strip()
        if block.language == "console":
            if not line.startswith("$ "):
                continue  # output shown in the docs
            line = line[2:]
        words = shlex.split(line, comments=True)
        if not words:
            continue
        env = {}
        while words and ENV_ASSIGNMENT.match(words[0]):
            name, value = ENV_ASSIGNMENT.match(words.pop(0)).groups()
            env[name] = value
        if not words or words[0] != "flce-policy" or SHELL_OPERATORS & set(words) or "$(" in line or "`" in line:
            raise ValueError(
                f"{block.where.rsplit(':', 1)[0]}:{number}: not a plain flce-policy command ({line!r}); "
                "run it elsewhere or mark the block (docs-test: gpu-only / install, with a reason)"
            )
        commands.append((number, env, words[1:]))
    return commands


def run_shell(unit: Unit, workdir: Path) -> None:
    block = unit.blocks[0]
    file = block.where.rsplit(":", 1)[0]
    commands = [(f"{file}:{number}", env, args) for number, env, args in shell_commands(block)]
    (workdir / "_docs_commands.json").write_text(json.dumps(commands))
    log = workdir / "_docs_cli.log"
    process = _warm_start.run_script(
        CLI_DRIVER, ["_docs_cli.py", "_docs_commands.json"], str(workdir), _environment(), str(log)
    )
    _wait(unit, [process])
    if process.exitcode != 0:
        output = log.read_text()
        started = re.findall(r"docs-test: running (\S+: .*)", output)
        _fail(started[-1] if started else unit.where, "this command failed", process.exitcode, output)


def run_unit(unit: Unit, workdir: Path) -> None:
    _write_files(unit, workdir)
    if unit.blocks[0].language in PYTHON:
        run_python(unit, workdir)
    else:
        run_shell(unit, workdir)


# --------------------------------------------------------------------------- the docs


def _collect():
    params = []
    for path in DOCS:
        for item in units(path):
            if isinstance(item, Block):
                kind = next(k for k in SKIP_KINDS if item.marker(k))
                reason = f"{item.where}: {kind}: {item.marker(kind)}"
                params.append(pytest.param(None, id=item.where, marks=pytest.mark.skip(reason=reason)))
            else:
                params.append(pytest.param(item, id=item.where))
    return params


@pytest.mark.parametrize("unit", _collect())
def test_doc_block_runs_as_written(unit: Unit, tmp_path: Path):
    run_unit(unit, tmp_path)


def test_readme_setup_is_what_ci_runs():
    """README's set-up block is skipped here because CI runs it: each of its commands is in .ci/run."""

    def normalised(command: str) -> str:
        return " ".join(word for word in shlex.split(command) if word != "-q")

    setup = [b for b in parse(ROOT / "README.md") if b.marker("install")]
    assert len(setup) == 1, "README has one set-up block marked 'docs-test: install'"
    readme = [normalised(c) for line in setup[0].code.splitlines() for c in line.split("&&") if c.strip()]
    ci = {normalised(line) for line in (ROOT / ".ci" / "run").read_text().splitlines() if not line.startswith("#")}
    missing = [c for c in readme if c not in ci]
    assert readme and not missing, f"README's set-up commands missing from .ci/run: {missing}"


# --------------------------------------------------------------------------- the runner itself


SAMPLE = """\
# A page

```python
x = 1
```

<!-- docs-test: continues -->
```python
assert x == 1
raise RuntimeError("boom")
```

<!-- docs-test: gpu-only, needs CUDA -->
```bash
flce-policy tune --out a.yaml
```

```console
$ FLCE_X=1 flce-policy validate p.yaml  # mypkg/ is here, but not on the script's path
output line
```

<!-- docs-test: file p.yaml -->
```yaml
version: 1
default: {strategy: "mypkg.rules:Half"}
```

<!-- docs-test: file mypkg/rules.py -->
```python
from flce_policy.strategies import FixedChunkSize as Half
```
"""


def test_runner_names_the_file_and_line_that_failed(tmp_path: Path):
    path = tmp_path / "page.md"
    chain, skipped, console = units(path, SAMPLE)
    assert [b.line for b in chain.blocks] == [3, 8] and skipped.marker("gpu-only") == "needs CUDA"
    assert [b.marker("file") for b in console.files] == ["p.yaml", "mypkg/rules.py"]
    with pytest.raises(pytest.fail.Exception, match=r"page\.md:8: this python block failed") as failed:
        run_unit(chain, tmp_path)
    assert f'File "{path}", line 10' in str(failed.value)  # the traceback points into the Markdown
    assert shell_commands(console.blocks[0]) == [(19, {"FLCE_X": "1"}, ["validate", "p.yaml"])]
    # as from a shell: the installed script does not see the working directory's packages
    with pytest.raises(
        pytest.fail.Exception, match=r"page\.md:19: flce-policy validate p.yaml: this command"
    ) as failed:
        run_unit(console, tmp_path)
    assert "No module named 'mypkg'" in str(failed.value)
    assert (tmp_path / "mypkg" / "rules.py").is_file()


@pytest.mark.parametrize(
    "text, message",
    [
        ("```bash\npip install x\n```\n", "not a plain flce-policy command"),
        ("```bash\nflce-policy probe | head\n```\n", "not a plain flce-policy command"),
        ("<!-- docs-test: gpu-only -->\n```python\n```\n", "needs its argument"),
        ("<!-- docs-test: skip -->\n```python\n```\n", "unknown docs-test marker"),
        ("<!-- docs-test: continues -->\n```python\n```\n", "no python block before it"),
        ("<!-- docs-test: gpu-only, x -->\n\ntext\n```python\n```\n", "right above a fence"),
    ],
    ids=["not-the-cli", "a-pipe", "no-reason", "unknown-marker", "continues-nothing", "marker-astray"],
)
def test_runner_refuses_unclear_blocks(tmp_path: Path, text: str, message: str):
    with pytest.raises(ValueError, match=message):
        for unit in units(tmp_path / "page.md", text):
            if isinstance(unit, Unit) and unit.blocks[0].language in SHELL:
                shell_commands(unit.blocks[0])
