"""Tests only: stop Triton's interpreter from re-patching ``triton.language`` at every device-function call.

Under ``TRITON_INTERPRET=1`` a kernel launch patches ``triton.language`` (builtins swapped for
their numpy versions, restored when the launch ends), and then every call of a ``@triton.jit``
function inside the kernel, per program, runs the patching again: ``inspect.getmembers`` over
``tl``, ``tl.tensor`` and ``tl.math``. Most of those calls are Triton's own reductions (``tl.max``,
``tl.sum``, ``tl.argmax``: 4.6k of them in one vocab-tiled call of ``test_vocab_tiled.py``). After a
launch's first such call the repeats change nothing (the builtins are already swapped, Triton never
restores a helper's patching, the rest is set to equal functions), yet they were 40% of that
call's CPU time (8.3 s -> 4.1 s without them). Here a call whose ``triton.language`` modules were
already patched during the running launch skips it; the launch itself and each first call patch as
before. The kernels compute bit for bit what they computed. With a Triton whose interpreter lacks
these internals nothing is changed.

Also kept: the interpreter's Triton -> numpy dtype table, which it otherwise builds again at every
cast, load and splat (``keep_numpy_dtype_table``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

__all__ = ["for_tests", "keep_numpy_dtype_table", "skip_repeated_lang_patching"]

#: Set to 1 to run Triton's interpreter as shipped (to compare, or to rule this module out).
STOCK_INTERPRETER_VARIABLE = "FLCE_TESTS_STOCK_INTERPRETER"


def for_tests() -> bool:
    """What conftest and the tests' own worker processes call: the skip (and the dtype table kept) when the
    kernels are interpreted."""
    if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get(STOCK_INTERPRETER_VARIABLE) == "1":
        return False
    keep_numpy_dtype_table()
    return skip_repeated_lang_patching()


def keep_numpy_dtype_table() -> bool:
    """Remember the interpreter's Triton -> numpy dtype answers instead of building its 19-entry table again
    at every cast, load and splat (180k times in tests/test_loss_kernel.py's option checks, 7% of their
    CPU time). The same answer for the same dtype; False (nothing changed) where the interpreter differs."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    stock: Callable[[Any], Any] | None = getattr(interpreter, "_get_np_dtype", None)
    if stock is None:
        return False
    if getattr(stock, "keeps_table", False):
        return True
    answers: dict[Any, Any] = {}

    def np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):  # a block's numpy dtype is its element's, pointers included
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return stock(tt_dtype)
        if tt_dtype not in answers:
            answers[tt_dtype] = stock(tt_dtype)
        return answers[tt_dtype]

    np_dtype.keeps_table = True
    interpreter._get_np_dtype = np_dtype
    return True


class _NothingToRestore:
    def restore(self) -> None:
        pass


def skip_repeated_lang_patching() -> bool:
    """Install the skip once per process; False (and nothing changed) where the interpreter differs."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    stock_patch: Callable[[Any], Any] | None = getattr(interpreter, "_patch_lang", None)
    launcher = getattr(interpreter, "GridExecutor", None)
    if stock_patch is None or launcher is None or not hasattr(interpreter, "InterpretedFunction"):
        return False
    if getattr(stock_patch, "skips_repeats", False):
        return True
    stock_launch = launcher.__call__
    lang_module_ids = {id(tl), id(tl.core)}
    #: One entry per running launch: None until its own patching, then the ids of the lang modules
    #: patched since it started.
    launches: list[set[int] | None] = []

    langs_by_globals: dict[tuple[int, int], set[int]] = {}  # (id, size) of a globals dict: its lang modules

    def langs_of(fn) -> set[int]:
        # keyed by size too: the interpreter adds names to a module's globals when it first rewrites one
        key = (id(fn.__globals__), len(fn.__globals__))
        if key not in langs_by_globals:
            langs_by_globals[key] = {id(value) for value in fn.__globals__.values()} & lang_module_ids
        return langs_by_globals[key]

    def launch(self, *args, **kwargs):
        launches.append(None)
        try:
            return stock_launch(self, *args, **kwargs)
        finally:
            launches.pop()

    def patch_lang(fn):
        langs = langs_of(fn)
        if not launches:
            return stock_patch(fn)
        if launches[-1] is not None and langs <= launches[-1]:
            return _NothingToRestore()  # a helper inside a launch that patched these modules already
        scope = stock_patch(fn)
        # the launch's own patching (restored when it ends), or a helper's first (``tl.max`` sees
        # ``tl.core``): Triton never restores a helper's, so it holds for the rest of the launch
        launches[-1] = langs if launches[-1] is None else launches[-1] | langs
        return scope

    patch_lang.skips_repeats = True
    launcher.__call__ = launch
    interpreter._patch_lang = patch_lang
    return True
