"""The text a trained-inputs model learns from: the Python sources that ship with this machine.

Every ``*.py`` file under the standard library and site-packages (``sysconfig``'s ``stdlib`` and
``purelib``), each named by its root and its path below it (``stdlib/json/decoder.py``). A file
goes to the held-out split when a hash of that name falls below the held-out share, so the split
depends on the name alone: a file is held out on every machine that has it, whatever else is
installed. Files are then taken in the order of another hash of the name (a shuffle that is the
same on every run) until the byte budget is spent, so a small budget still samples many packages.
Files that cannot be read, are not UTF-8, or are larger than ``MAX_FILE_BYTES`` (generated tables,
not code anyone wrote) are skipped.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Corpus", "SourceFile", "python_sources", "split_corpus", "is_held_out"]

#: Salts of the two name hashes: one decides the split, the other the order files are taken in.
_SPLIT_SALT, _ORDER_SALT = "flce-policy/held-out", "flce-policy/order"
#: Larger files are generated data (unicode tables, test vectors); they would crowd a small budget.
MAX_FILE_BYTES = 1_000_000


@dataclass(frozen=True)
class SourceFile:
    name: str  # root label and relative path, e.g. "stdlib/json/decoder.py"
    path: Path


@dataclass(frozen=True)
class Corpus:
    """The texts of each split, in the order they were taken; ``*_names`` say which files they are."""

    train_names: tuple[str, ...]
    train_texts: tuple[str, ...]
    held_out_names: tuple[str, ...]
    held_out_texts: tuple[str, ...]

    @property
    def train_bytes(self) -> int:
        return sum(len(t.encode()) for t in self.train_texts)

    @property
    def held_out_bytes(self) -> int:
        return sum(len(t.encode()) for t in self.held_out_texts)


def python_sources(roots: dict[str, Path] | None = None) -> list[SourceFile]:
    """The ``*.py`` files under ``roots`` (label -> folder; default stdlib and purelib), sorted by name.

    A folder that is itself another root (site-packages inside the stdlib folder) is left to that
    root, so no file is listed twice; ``__pycache__`` folders are not entered. ``os.walk`` with one
    ``realpath`` per folder, not per file: file system calls are slow on some machines (gVisor).
    """
    if roots is None:
        paths = sysconfig.get_paths()
        roots = {"stdlib": Path(paths["stdlib"]), "purelib": Path(paths["purelib"])}
    real_roots = {os.path.realpath(root) for root in roots.values()}
    files: list[SourceFile] = []
    for label, root in roots.items():
        if not root.is_dir():
            continue
        own = os.path.realpath(root)
        for folder, dirs, names in os.walk(root):
            dirs[:] = [
                d
                for d in dirs
                if d != "__pycache__" and os.path.realpath(os.path.join(folder, d)) not in real_roots - {own}
            ]
            relative = Path(folder).relative_to(root)
            for name in names:
                if name.endswith(".py"):
                    files.append(SourceFile(f"{label}/{(relative / name).as_posix()}", Path(folder, name)))
    return sorted(files, key=lambda f: f.name)


def _unit_hash(salt: str, name: str) -> float:
    """A number in [0, 1) fixed by ``salt`` and ``name``."""
    digest = hashlib.sha256(f"{salt}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def is_held_out(name: str, held_out_share: float) -> bool:
    return _unit_hash(_SPLIT_SALT, name) < held_out_share


def _read_text(path: Path) -> str | None:
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None
        return path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _take(files: Iterable[SourceFile], budget: int) -> Iterator[tuple[str, str]]:
    """(name, text) of readable files, in order, until ``budget`` bytes are taken (the last file may pass it)."""
    taken = 0
    for file in files:
        if taken >= budget:
            return
        text = _read_text(file.path)
        if not text:
            continue
        taken += len(text.encode())
        yield file.name, text


def split_corpus(files: list[SourceFile], *, train_bytes: int, held_out_bytes: int, held_out_share: float) -> Corpus:
    """Split ``files`` by name hash and take each split, in hash order, up to its byte budget."""
    if not 0 < held_out_share < 1:
        raise ValueError(f"held_out_share must be in (0, 1), got {held_out_share}")
    ordered = sorted(files, key=lambda f: (_unit_hash(_ORDER_SALT, f.name), f.name))
    held = [f for f in ordered if is_held_out(f.name, held_out_share)]
    train = [f for f in ordered if not is_held_out(f.name, held_out_share)]
    train_pairs = list(_take(train, train_bytes))
    held_pairs = list(_take(held, held_out_bytes))
    return Corpus(
        train_names=tuple(n for n, _ in train_pairs),
        train_texts=tuple(t for _, t in train_pairs),
        held_out_names=tuple(n for n, _ in held_pairs),
        held_out_texts=tuple(t for _, t in held_pairs),
    )
