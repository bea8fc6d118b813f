"""Integer helpers and byte-size parsing/formatting shared by every layer."""

from __future__ import annotations

import re
from decimal import Decimal

__all__ = ["cdiv", "next_pow2", "prev_pow2", "parse_bytes", "format_bytes", "exact_size"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative integers."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1), as triton.next_power_of_2."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def prev_pow2(n: int) -> int:
    """Largest power of two <= n; n must be >= 1."""
    if n < 1:
        raise ValueError(f"prev_pow2 needs n >= 1, got {n}")
    return 1 << (n.bit_length() - 1)


def parse_bytes(value: int | float | str) -> int:
    """Parse a byte count: an integer, or a string such as "1GiB", "512 MiB", "1.5GB".

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB)
    powers of 1000; a bare number is bytes. Raises ValueError on anything else, on a
    negative size, and on a fractional number of bytes.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a byte size, got the boolean {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"a byte count must be whole, got {value!r}")
        size = int(value)
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"cannot parse {value!r} as a byte size; use a number of bytes or a number "
                "with a unit: B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (of 1024)"
            )
        exact = Decimal(match.group(1)) * _UNITS[unit]
        if exact != exact.to_integral_value():
            raise ValueError(f"a byte count must be whole, got {value!r} = {exact} bytes")
        size = int(exact)
    else:
        raise ValueError(f"expected a byte size (int or string like '1GiB'), got {type(value).__name__}")
    if size < 0:
        raise ValueError(f"a byte size cannot be negative, got {value!r}")
    return size


def format_bytes(n: int | float) -> str:
    """Human-readable binary size: 1073741824 -> '1.00 GiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def exact_size(n: int) -> int | str:
    """``n`` bytes in the largest binary unit that holds it whole, for a config file: 2**31 -> '2GiB'.

    1002 MiB stays '1002MiB' and a size no unit divides stays the integer, so ``parse_bytes``
    reads back exactly ``n``, never a rounded neighbour.
    """
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        size = _UNITS[unit.lower()]
        if n and n % size == 0:
            return f"{n // size}{unit}"
    return n
