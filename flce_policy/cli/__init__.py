"""The ``flce-policy`` command: the engine's command-line side.

``commands`` (the parser and ``probe``, ``explain``, ``validate``; ``bench`` hands over to
:mod:`flce_policy.benchmarks.cli`) and ``tune`` (measure chunk sizes on this GPU, write the fastest
that fits as a policy file).

May import anything in flce_policy; nothing imports it.
"""

from flce_policy.cli.commands import main

__all__ = ["main"]
