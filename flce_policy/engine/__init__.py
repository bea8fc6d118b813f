"""The planning engine: from the GPU and the policy file to the geometry a loss call runs.

``probe`` (which GPU: NVML, torch fallback), ``config`` (the policy YAML's schema), ``policy``
(:class:`FLCEPolicy`: the rule for a device, its strategy asked once per problem, the OOM settings),
``policy_keys`` (a policy named by a key inside a compiled graph), ``strategy_cache`` (a strategy given
to the loss directly, asked once per problem).

Data flows one way: probe -> policy -> strategy -> geometry. May import: :mod:`flce_policy.plan` and
:mod:`flce_policy.strategies`; never the kernels, the loss, ``distributed``, ``integrations`` or ``cli``.
"""
