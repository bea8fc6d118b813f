"""Quick look during development: one shape, a few methods, printed as text."""

from __future__ import annotations

import sys

from .methods import default_methods
from .suite import expand_shapes, parse_shapes, run_suite


def main(argv: list[str]) -> None:
    shapes = expand_shapes([parse_shapes(s) for s in argv[1:]], [(8192, 5376, 262144)])
    wanted = set(argv[0].split(",")) if argv else set()
    methods = [m for m in default_methods() if not wanted or m.name in wanted]
    records = run_suite(
        shapes, methods, on_record=lambda r: print(r.shape, r.method, r.median_ms, r.peak_bytes, r.status, flush=True)
    )
    for r in records:
        ratio = f"{r.x_floor:.3f}" if r.x_floor else "-"
        peak = f"{r.peak_bytes / 2**30:.2f}" if r.peak_bytes is not None else "-"
        shape = "x".join(map(str, r.shape))
        print(f"{shape:>20} {r.method:28} {r.median_ms or 0:9.2f} ms  x{ratio}  {peak} GiB  {r.status}")


if __name__ == "__main__":
    main(sys.argv[1:])
