"""Measured picks on disk: a second run of the same training starts from its first run's picks, measuring nothing.

One JSON file per pick, under ``$FLCE_POLICY_CACHE`` (else the user's cache folder, ``platformdirs``), named by a
hash of its key: the GPU (name, total memory, driver), the torch, Triton and flce-policy versions, the problem's BT
bucket (:func:`flce_policy.plan.measuring.bucket_problem`), the kind of call and the ``measured`` strategy's
parameters. Anything else changes the key, so a pick is never used
where it was not measured. A file that cannot be read, does not parse, or holds another key (foreign: copied from
elsewhere) is ignored with one :class:`PickCacheWarning`, never trusted; the pick is measured again and rewritten.
Files are written whole and renamed into place, so ranks and processes sharing the folder never read half a file.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.measuring import BucketPick, bucket_label, bucket_problem
from flce_policy.plan.problem import Problem

__all__ = [
    "CACHE_ENV_VAR",
    "CachedPick",
    "PickCacheWarning",
    "PickKey",
    "cache_dir",
    "clear",
    "entries",
    "environment",
    "load",
    "pick_key",
    "store",
]

#: Names the folder measured picks are kept in (default: the user's cache folder for flce-policy).
CACHE_ENV_VAR = "FLCE_POLICY_CACHE"
_FORMAT = "flce-policy measured pick 1"
_warned: set[str] = set()


class PickCacheWarning(UserWarning):
    """A cached pick was ignored (corrupt, foreign) or could not be written; the pick is measured instead."""


class PickKey(BaseModel):
    """Everything a pick depends on; a file is used only under the key it was written with."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu: str
    total_memory_bytes: int
    driver: str
    torch: str
    triton: str
    flce_policy: str
    problem: str
    kind: str
    strategy: str


class CachedPick(BaseModel):
    """One file: its key, the geometry picked (rows of the bucket's top BT), when, and the candidates' times."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["flce-policy measured pick 1"]
    key: PickKey
    chunk_size: int = Field(gt=0)
    vocab_chunk: int = Field(gt=0)
    slab_form: Literal["logits", "scaled_exp", "scaled_exp_rows", "scaled_exp_ws"]
    measured_at: str
    times_ms: dict[str, float] = {}

    def pick(self) -> BucketPick:
        """The bucket's pick, its source saying when it was measured."""
        return BucketPick(self.chunk_size, self.vocab_chunk, self.slab_form, f"cache, measured {self.measured_at}")


def cache_dir() -> Path:
    """``$FLCE_POLICY_CACHE``, else ``<user cache dir>/flce-policy/picks``."""
    given = os.environ.get(CACHE_ENV_VAR, "").strip()
    if given:
        return Path(given)
    import platformdirs

    return Path(platformdirs.user_cache_dir("flce-policy", appauthor=False)) / "picks"


@functools.cache
def _versions() -> tuple[str, str, str, str]:
    """(driver, torch, triton, flce-policy) versions of this process."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    try:
        ours = version("flce-policy")
    except PackageNotFoundError:
        ours = "unknown"
    return _driver(), torch.__version__, triton_version, ours


def _driver() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            text = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return text.decode() if isinstance(text, bytes) else str(text)
    except Exception:  # noqa: BLE001 - no NVML (the CPU, a container without it): the key says so
        return "unknown"


def environment(device: DeviceInfo) -> dict[str, Any]:
    """The GPU and software half of a key."""
    driver, torch_version, triton_version, ours = _versions()
    return {
        "gpu": device.name,
        "total_memory_bytes": device.total_memory_bytes,
        "driver": driver,
        "torch": torch_version,
        "triton": triton_version,
        "flce_policy": ours,
    }


def pick_key(device: DeviceInfo, problem: Problem, kind: str, strategy: str) -> PickKey:
    """The key of the pick of ``problem``'s bucket for calls of ``kind`` under a ``measured`` strategy (its
    params_key)."""
    bucket = bucket_problem(problem)
    shape = f"{bucket_label(bucket)} H={bucket.hidden} V={bucket.vocab} {bucket.dtype} tp{bucket.tp_size}"
    return PickKey(**environment(device), problem=shape, kind=kind, strategy=strategy)


def _path(key: PickKey) -> Path:
    digest = hashlib.sha256(key.model_dump_json().encode()).hexdigest()[:32]
    return cache_dir() / f"{digest}.json"


def load(key: PickKey) -> CachedPick | None:
    """The pick stored under ``key``; None when there is none, or (with one warning) when its file is not to be
    trusted."""
    path = _path(key)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        _ignored(path, f"cannot be read ({err})")
        return None
    cached = _parsed(path, text)
    if cached is not None and cached.key != key:
        _ignored(path, "holds the pick of another GPU, version, problem or strategy (a foreign file)")
        return None
    return cached


def _parsed(path: Path, text: str) -> CachedPick | None:
    try:
        return CachedPick.model_validate(json.loads(text))
    except (ValueError, ValidationError) as err:
        _ignored(path, f"is not a pick this flce-policy wrote ({str(err).splitlines()[0][:120]})")
        return None


def store(key: PickKey, pick: BucketPick, times: dict[Geometry, float]) -> None:
    """Keep ``pick`` under ``key`` (a failure to write is one warning: the run goes on)."""
    cached = CachedPick(
        format=_FORMAT,
        key=key,
        chunk_size=pick.rows,
        vocab_chunk=pick.vocab_chunk,
        slab_form=pick.slab_form,
        measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        times_ms={f"{g.chunk_size} {g.slab_form}": round(t * 1e3, 4) for g, t in times.items()},
    )
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        partial.write_text(cached.model_dump_json(indent=1), encoding="utf-8")
        os.replace(partial, path)
    except OSError as err:
        _warn(path, f"flce_policy: cannot write the measured pick to {path} ({err}); the next run measures again")


def entries() -> list[tuple[Path, CachedPick | None]]:
    """Every pick file in the cache folder and what it holds (None: not a valid pick), oldest first."""
    folder = cache_dir()
    if not folder.is_dir():
        return []
    found = []
    for path in sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime):
        try:
            cached = CachedPick.model_validate(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, ValidationError):
            cached = None
        found.append((path, cached))
    return found


def clear() -> int:
    """Delete every pick file (and any half-written one); returns how many picks were deleted."""
    folder = cache_dir()
    if not folder.is_dir():
        return 0
    count = 0
    for path in [*folder.glob("*.json"), *folder.glob("*.tmp")]:
        path.unlink(missing_ok=True)
        count += path.suffix == ".json"
    return count


def _ignored(path: Path, why: str) -> None:
    _warn(path, f"flce_policy: ignored the measured pick in {path}: it {why}; measuring instead")


def _warn(path: Path, message: str) -> None:
    """One warning per file and process: a training loop's every problem must not repeat it."""
    if str(path) in _warned:
        return
    _warned.add(str(path))
    warnings.warn(message, PickCacheWarning, stacklevel=4)
