"""One loss call below its front door (:mod:`flce_policy.loss`): everything between the public
function's arguments and the kernel driver.

``options`` (:class:`LossOptions`: the scalar options, validated and documented), ``plan`` (the call's
arguments as one value, and its plan: what runs, at which geometry; the plan of a head whole on this
rank), ``resolve`` (the tensor checks and the call's problem and geometry: the one place the local plan,
the compiled op and the vocab-parallel path get them), ``targets`` (the target-range check, finished
while the kernels run), ``run`` (a plan run: eagerly or as the compiled op), ``autograd`` (the autograd
Function: forward and backward through the driver), ``custom_op`` (the same as one opaque custom op, for
``torch.compile``) and ``output`` (what the call returns: the loss, or :class:`FLCEOutput`).

May import: :mod:`flce_policy.plan`, :mod:`flce_policy.engine`, :mod:`flce_policy.strategies` and
:mod:`flce_policy.kernels`; never the front door, ``distributed``, ``integrations`` or ``cli``.
"""
