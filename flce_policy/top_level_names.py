"""Keep the repository's top-level folders from shadowing installed packages of the same name.

``kernels/``, ``strategies/``, ``configs/`` and ``benchmarks/`` are the sources of ``flce_policy.kernels``
etc. (setuptools' ``package-dir``). Where the repository root is on ``sys.path`` (``python -m pytest``, a
script run from the root), ``import kernels`` would find the folder before Hugging Face's ``kernels``
that transformers imports. Each folder's ``__init__`` calls :func:`hand_over` when it is imported under
its top-level name, and the import gets the installed package instead (docs/layout.md says why this and
not PEP 420 namespace portions). The package itself never imports it.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def hand_over(name: str, folder: str) -> None:
    """Replace ``sys.modules[name]`` (the repository's ``folder``, mid-import) by the installed package ``name``.

    The search is the one ``import name`` makes, less the path entries that resolve to the folder's parent
    (the repository root). ModuleNotFoundError where nothing else provides ``name``, as outside the repository.
    """
    root = os.path.realpath(os.path.dirname(folder))
    path = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != root]
    spec = None
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        spec = find_spec(name, path) if finder is importlib.machinery.PathFinder else find_spec(name, None)
        if spec is not None and spec.origin != os.path.join(folder, "__init__.py"):
            break
        spec = None
    if spec is None:
        raise ModuleNotFoundError(f"No module named {name!r} (the repository's {folder}/ is not it)", name=name)
    module = importlib.util.module_from_spec(spec)
    # the import in progress returns what sys.modules holds once this folder's __init__ has run
    sys.modules[name] = module
    if spec.loader is not None:
        spec.loader.exec_module(module)
