"""The filter-rest benchmark's command line on the interpreter (the GPU run is the trained stage's)."""

from __future__ import annotations

import json

from flce_policy.benchmarks import filter_rest


def test_writes_every_arm_per_round_and_its_ratio_to_dense(tmp_path):
    out = tmp_path / "rest.json"
    assert filter_rest.main(["--shapes", "64x16x256", "--calls", "2", "--rounds", "2", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["shape"] == "64x16x256" and row["calls"] == 2
    assert set(row["ms_per_call"]) == set(filter_rest.ARMS)
    assert all(len(times) == 2 and min(times) > 0 for times in row["ms_per_call"].values())
    assert row["over_dense"]["dense"] == 1.0
