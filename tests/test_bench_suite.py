"""run_suite's order of calls, back to back or interleaved, with the CUDA timing stubbed (a call log)."""

from __future__ import annotations

import pytest

from flce_policy.benchmarks import suite
from flce_policy.benchmarks.methods import Method, Unavailable

SHAPE = (8, 4, 16)


@pytest.fixture
def calls(monkeypatch):
    """Each timed call, warm-up and peak call logged as (what, row); a call takes 10 ms plus its row's index."""
    log: list[tuple[str, str]] = []

    def warm_up(step, calls):
        for _ in range(calls):
            log.append(("warm", step.row))

    def time_sample(step, *, busy_start=False, sustained_s=None):
        step()
        log.append(("time", step.row))
        # a sustained sample: 100 ms more per second of window, so a test sees which window reached it
        return 10.0 + step.index + (0.5 if busy_start else 0.0) + (100.0 * sustained_s if sustained_s else 0.0)

    def peak_bytes(step):
        log.append(("peak", step.row))
        return 100 * (step.index + 1)

    monkeypatch.setattr(suite, "warm_up", warm_up)
    monkeypatch.setattr(suite, "time_sample", time_sample)
    monkeypatch.setattr(suite, "peak_bytes", peak_bytes)
    monkeypatch.setattr(suite, "measure", _measure_with(warm_up, time_sample, peak_bytes))
    return log


def _measure_with(warm_up, time_sample, peak_bytes):
    def measure(step, *, warmup, repeats, busy_start, sustained_s):
        warm_up(step, warmup)
        times = tuple(time_sample(step, busy_start=busy_start, sustained_s=sustained_s) for _ in range(repeats))
        return suite.Measurement(times, peak_bytes(step))

    return measure


def _row(name: str, index: int, *, fail_on_call: int | None = None, unavailable: bool = False) -> Method:
    def build(_inputs):
        if unavailable:
            raise Unavailable("not installed")
        count = [0]

        def step():
            count[0] += 1
            if fail_on_call is not None and count[0] == fail_on_call:
                raise RuntimeError("broke on its second timed call")

        step.row, step.index = name, index
        return step

    return Method(name, "floor" if name == "gemm_floor" else "test", step=build)


def _run(rows, **options):
    return suite.run_suite([SHAPE], rows, warmup=1, repeats=5, inputs_for=lambda shape: object(), **options)


def test_back_to_back_times_each_row_s_calls_together(calls):
    records = _run([_row("gemm_floor", 0), _row("a", 1)])
    timed = [row for what, row in calls if what == "time"]
    assert timed == ["gemm_floor"] * 5 + ["a"] * 5
    assert [(r.method, r.median_ms, r.peak_bytes) for r in records] == [("gemm_floor", 10.0, 100), ("a", 11.0, 200)]
    assert records[1].x_floor == pytest.approx(1.1)


def test_interleaved_rows_are_warmed_first_then_timed_in_rounds_each_starting_one_row_later(calls):
    records = _run([_row("gemm_floor", 0), _row("a", 1), _row("b", 2)], interleave=True, busy_start=True)
    assert calls[:3] == [("warm", "gemm_floor"), ("warm", "a"), ("warm", "b")]
    timed = [row for what, row in calls if what == "time"]
    rounds = [["gemm_floor", "a", "b"], ["a", "b", "gemm_floor"], ["b", "gemm_floor", "a"]]
    assert timed == [row for i in range(5) for row in rounds[i % 3]]
    assert [row for what, row in calls if what == "peak"] == ["gemm_floor", "a", "b"]
    assert [(r.method, r.times_ms, r.peak_bytes, r.status) for r in records] == [
        ("gemm_floor", (10.5,) * 5, 100, "ok"),
        ("a", (11.5,) * 5, 200, "ok"),
        ("b", (12.5,) * 5, 300, "ok"),
    ]
    assert [r.x_floor for r in records] == [pytest.approx(1.0), pytest.approx(11.5 / 10.5), pytest.approx(12.5 / 10.5)]


def test_an_interleaved_row_that_breaks_or_cannot_run_leaves_the_others_their_rounds(calls):
    rows = [_row("gemm_floor", 0), _row("broken", 1, fail_on_call=2), _row("peer", 2, unavailable=True), _row("a", 3)]
    records = _run(rows, interleave=True)
    timed = [row for what, row in calls if what == "time"]
    # broken: its second call raised; the rounds start at floor, broken, peer, a, floor (peer never runs)
    assert timed == ["gemm_floor", "broken", "a"] + ["a", "gemm_floor"] * 3 + ["gemm_floor", "a"]
    by_name = {r.method: r for r in records}
    assert by_name["broken"].status == "error: RuntimeError: broke on its second timed call"
    assert by_name["broken"].median_ms is None and by_name["broken"].x_floor is None
    assert by_name["peer"].status == "not installed" and by_name["peer"].times_ms == ()
    assert by_name["a"].median_ms == 13.0 and by_name["a"].x_floor == pytest.approx(1.3)
    assert [r.method for r in records] == ["gemm_floor", "broken", "peer", "a"]  # the methods' order


@pytest.mark.parametrize("interleave", [False, True])
def test_a_sustained_window_reaches_every_sample_of_every_row(calls, interleave):
    records = _run([_row("gemm_floor", 0), _row("a", 1)], interleave=interleave, sustained_s=1.5)
    assert [(r.method, r.times_ms) for r in records] == [("gemm_floor", (160.0,) * 5), ("a", (161.0,) * 5)]
    assert records[1].x_floor == pytest.approx(161.0 / 160.0)


# --- the sustained window's own arithmetic, with CUDA's events and the sizing call stubbed ---------------


class _Event:
    """A CUDA event stand-in: ``elapsed_time`` is the calls made between the two records, 40 ms each."""

    log: list[str] = []

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        self.at = len(_Event.log)

    def synchronize(self):
        pass

    def elapsed_time(self, later):
        return 40.0 * (later.at - self.at)


def test_time_sustained_fills_the_window_after_a_lead_in_and_returns_the_mean_call(monkeypatch):
    from flce_policy.benchmarks import measure

    _Event.log = []
    monkeypatch.setattr(measure.torch.cuda, "Event", _Event)
    monkeypatch.setattr(measure, "time_call", lambda step, *, busy_start: 100.0)  # the sizing call: 100 ms

    def step():
        _Event.log.append("call")

    # 2 s of 100 ms calls: 20 timed, a quarter of them (5) untimed first
    assert measure.time_sustained(step, 2.0) == pytest.approx(40.0)
    assert len(_Event.log) == 25


@pytest.mark.parametrize(
    "seconds, call_ms, calls", [(2.0, 100.0, 20), (2.0, 30.0, 67), (0.01, 400.0, 1), (1.0, 1000.0, 1)]
)
def test_sustained_calls_cover_the_window(seconds, call_ms, calls):
    from flce_policy.benchmarks.measure import sustained_calls

    assert sustained_calls(seconds, call_ms) == calls


@pytest.mark.parametrize("seconds, call_ms", [(0.0, 10.0), (1.0, 0.0), (-1.0, 5.0)])
def test_sustained_calls_refuse_an_empty_window_or_call(seconds, call_ms):
    from flce_policy.benchmarks.measure import sustained_calls

    with pytest.raises(ValueError, match="positive window and call time"):
        sustained_calls(seconds, call_ms)
