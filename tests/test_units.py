"""Integer helpers and byte sizes, against hand-computed values."""

from __future__ import annotations

import pytest

from flce_policy.plan.units import cdiv, format_bytes, next_pow2, parse_bytes, prev_pow2


@pytest.mark.parametrize(
    ("a", "b", "want"),
    [(0, 5, 0), (1, 1, 1), (7, 2, 4), (8, 2, 4), (9, 4, 3), (8192, 49, 168), (10**12 + 1, 10**6, 10**6 + 1)],
)
def test_cdiv(a, b, want):
    assert cdiv(a, b) == want


@pytest.mark.parametrize(
    ("n", "want"), [(0, 1), (1, 1), (2, 2), (3, 4), (5, 8), (168, 256), (1024, 1024), (1025, 2048), (2**40 + 1, 2**41)]
)
def test_next_pow2(n, want):
    assert next_pow2(n) == want


@pytest.mark.parametrize(
    ("n", "want"), [(1, 1), (2, 2), (3, 2), (100, 64), (1023, 512), (1024, 1024), (2**41 - 1, 2**40)]
)
def test_prev_pow2(n, want):
    assert prev_pow2(n) == want


@pytest.mark.parametrize("n", [0, -1, -1024])
def test_prev_pow2_rejects_non_positive(n):
    with pytest.raises(ValueError, match=">= 1"):
        prev_pow2(n)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (0, 0),
        (100, 100),
        (2048.0, 2048),
        ("0", 0),
        ("100", 100),
        (" 3 B ", 3),
        ("1kb", 1000),
        ("2KiB", 2048),
        (".5KiB", 512),
        ("1.5KiB", 1536),
        ("512 MiB", 536870912),
        ("1GiB", 1073741824),
        ("1gib", 1073741824),
        ("1GB", 1000000000),
        ("1.5GB", 1500000000),
        ("1.1GB", 1100000000),
        ("2TB", 2000000000000),
        ("1TiB", 1099511627776),
    ],
)
def test_parse_bytes(text, want):
    assert parse_bytes(text) == want


@pytest.mark.parametrize(
    "bad", ["", "abc", "GiB", "1XB", "1 GiB extra", "1e9", "-1", "-1GiB", "1,5GB", -1, 1.5, True, False, None, [1]]
)
def test_parse_bytes_rejects_bad_input(bad):
    with pytest.raises(ValueError):
        parse_bytes(bad)


@pytest.mark.parametrize("text", ["1.5", "2.5B", "0.5"])
def test_parse_bytes_rejects_fractional_byte_strings(text):
    with pytest.raises(ValueError, match="whole"):
        parse_bytes(text)


@pytest.mark.parametrize(
    ("n", "want"),
    [
        (0, "0 B"),
        (1, "1 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (524288, "512.00 KiB"),
        (2**20, "1.00 MiB"),
        (2**30, "1.00 GiB"),
        (1500000000, "1.40 GiB"),
        (2**40, "1.00 TiB"),
        (5 * 2**40, "5.00 TiB"),
        (2**50, "1024.00 TiB"),
    ],
)
def test_format_bytes(n, want):
    assert format_bytes(n) == want


@pytest.mark.parametrize("n", [1, 1000, 2**20, 3 * 2**30 + 12345])
def test_format_then_parse_is_close(n):
    value, unit = format_bytes(n).split()
    assert abs(parse_bytes(f"{value}{unit}") - n) <= 0.005 * n + 1
