"""The terms of a plan and what one costs: the layer every other one stands on.

``units`` (byte sizes), ``problem`` (the call's sizes: :class:`Problem`), ``device`` (what a GPU
offers: :class:`DeviceInfo`), ``geometry`` (the chunking to run: :class:`Geometry`), ``accumulator``
(grad_input's fp32 accumulator in borrowed bytes), ``oom`` (the OOM-fallback settings), the models
that price a geometry on a device: ``memory`` (predicted peak), ``memory_now`` (live free memory),
``cost_model`` (predicted time), ``collectives`` (a vocab-parallel head's collectives, for the cost model),
``weight_filter`` (the grad_weight filter's eps and tile size).

May import: nothing of flce_policy outside this package. Everything else imports it: the strategies
reason in these terms, the engine answers in them, the kernels run a :class:`Geometry`.
"""
