"""Shared test setup: run the Triton kernels on CPU under the interpreter unless told otherwise.

Triton picks interpreter or compiler when a kernel is decorated, i.e. when ``flce_policy.kernels``
is first imported, so the variable is set here, before any test module imports the kernels.
``setdefault`` leaves an explicit ``TRITON_INTERPRET=0`` (the GPU suite) untouched.

Under the interpreter, ``tests/_interpreter_patch.py`` drops its repeated patching of
``triton.language`` inside a launch (half the CPU time of a vocab-tiled call; bit-identical results).
``FLCE_TESTS_STOCK_INTERPRETER=1`` runs Triton's interpreter as shipped.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ["TRITON_INTERPRET"] == "1" and os.environ.get("FLCE_TESTS_STOCK_INTERPRETER") != "1":
    from _interpreter_patch import skip_repeated_lang_patching

    skip_repeated_lang_patching()
