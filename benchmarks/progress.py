"""The progress bar of a benchmark run: a rich bar on stderr, plus one line per finished row."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .methods import Method
from .suite import Record, format_shape

__all__ = ["SuiteProgress"]


class SuiteProgress:
    """A rich progress bar on stderr, plus one line per finished row (kept in logs, where bars do not render)."""

    def __init__(self, total: int) -> None:
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        self._bar = Progress(*columns, console=Console(stderr=True, markup=False))
        self._task = self._bar.add_task("starting", total=total)

    def __enter__(self) -> SuiteProgress:
        self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.stop()

    def started(self, shape: tuple[int, int, int], method: Method) -> None:
        self._bar.update(self._task, description=f"{format_shape(shape)} {method.name}")

    def finished(self, r: Record) -> None:
        ms = "-" if r.median_ms is None else f"{r.median_ms:.2f} ms"
        peak = "-" if r.peak_bytes is None else f"{r.peak_bytes / 2**30:.2f} GiB"
        self._bar.console.print(f"{format_shape(r.shape)} {r.method}: {ms}, peak {peak}, {r.status}")
        self._bar.advance(self._task)
