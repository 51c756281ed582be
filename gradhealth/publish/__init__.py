"""Where a report goes: the sink protocol and the logging sink (:mod:`.sinks`), the flat metric keys every
logger adapter writes (:mod:`.metrics`), the short console form (:mod:`.brief`), say-once (:mod:`.once`),
and the policy that warns or raises (:mod:`.policy`).

A new sink implements :class:`.sinks.Sink` (TensorBoard's is ``gradhealth.integrations.tensorboard``).
Imports: every stage below; never ``check``.
"""
