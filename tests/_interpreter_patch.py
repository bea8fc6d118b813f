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
cast, load and splat (``keep_numpy_dtype_table``), and each block shape's ``constexpr`` dims, ``numel``
and tuple type, which ``tl.tensor`` otherwise builds again for every tensor (``build_tensor_shapes_once``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

__all__ = ["build_tensor_shapes_once", "for_tests", "keep_numpy_dtype_table", "skip_repeated_lang_patching"]

#: Set to 1 to run Triton's interpreter as shipped (to compare, or to rule this module out).
STOCK_INTERPRETER_VARIABLE = "FLCE_TESTS_STOCK_INTERPRETER"


def for_tests() -> bool:
    """What conftest and the tests' own worker processes call: the skip (and the dtype table kept) when the
    kernels are interpreted."""
    if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get(STOCK_INTERPRETER_VARIABLE) == "1":
        return False
    keep_numpy_dtype_table()
    build_tensor_shapes_once()
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


#: The names Triton 3.x's ``tl.tensor.__init__`` uses: what ``build_tensor_shapes_once`` stands in for.
_TENSOR_INIT_NAMES = (
    "super", "__init__", "handle", "is_block", "shape", "constexpr", "math", "prod", "numel", "type", "scalar",
    "dtype", "tuple",
)  # fmt: skip


def build_tensor_shapes_once() -> bool:
    """Give each new ``tl.tensor`` its shape (a ``tl.tuple`` of ``constexpr``) and ``numel`` from a table kept
    per block shape, instead of building the constexprs and the tuple's type again: the interpreter makes a
    tensor at every operation of every program (760k in one vocab-tiled test of 37 x 301; that building was
    a tenth of its profiled time, about 5-10% of its CPU time measured on a busy machine). The same attribute
    values as Triton's ``tensor.__init__`` (each tensor its own ``tl.tuple``; the constexprs in it, its type
    and ``numel`` shared, none of them ever changed in place). False (nothing changed) where Triton's tensor
    is not the one this was written against."""
    try:
        import triton.language as tl
    except ImportError:
        return False
    tensor, tuple_of = tl.core.tensor, tl.core.tuple
    stock_init = tensor.__init__
    if getattr(stock_init, "builds_shapes_once", False):
        return True
    if stock_init.__code__.co_names != _TENSOR_INIT_NAMES:
        return False
    shapes: dict[tuple, tuple] = {}

    def init(self, handle, type):
        self.handle = handle
        shape = type.shape if type.is_block() else ()
        entry = shapes.get(shape)
        if entry is None:
            dims = [tl.core.constexpr(s) for s in shape]
            entry = shapes[shape] = (tl.core.constexpr(math.prod(shape)), dims, tuple_of(dims).type)
        self.numel, dims, shape_type = entry
        self.type = type
        self.dtype = type.scalar
        self.shape = tuple_of(dims, shape_type)

    init.builds_shapes_once = True
    tensor.__init__ = init
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
