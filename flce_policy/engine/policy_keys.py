"""Policies by key, for the compiled loss's custom op, which takes ints, not Python objects.

Kept free of torch, like the policy that registers itself here when built.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["DEFAULT_POLICY_KEY", "live_policy", "policy_key", "register_policy"]

#: The key of ``policy=None``: the op resolves the loss's default policy (``$FLCE_POLICY_CONFIG``) at run time.
DEFAULT_POLICY_KEY = 0
#: Live FLCEPolicy objects by id; an entry goes when its policy is collected, and a new policy at a
#: reused id replaces it (Dynamo's guard on the id then matches the new object, the right one).
_POLICIES: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def register_policy(policy: Any) -> None:
    """Make ``policy`` reachable by its key (``FLCEPolicy.__init__`` calls this)."""
    _POLICIES[id(policy)] = policy


def policy_key(policy: Any) -> int:
    """The key of ``policy`` (None or a registered FLCEPolicy); pure, so Dynamo traces it as a guarded constant."""
    return DEFAULT_POLICY_KEY if policy is None else id(policy)


def live_policy(key: int) -> Any:
    """The policy behind ``key``: None for the default, else the live FLCEPolicy registered under it."""
    if key == DEFAULT_POLICY_KEY:
        return None
    policy = _POLICIES.get(key)
    if policy is None:
        raise RuntimeError(
            "flce_policy: the FLCEPolicy this compiled graph was traced with no longer exists; keep the policy "
            "object alive while the compiled function runs"
        )
    return policy
