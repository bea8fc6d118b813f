"""Shared test setup: run the Triton kernels on CPU under the interpreter unless told otherwise.

Triton picks interpreter or compiler when a kernel is decorated, i.e. when ``flce_policy.kernels``
is first imported, so the variable is set here, before any test module imports the kernels.
``setdefault`` leaves an explicit ``TRITON_INTERPRET=0`` (the GPU suite) untouched.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
