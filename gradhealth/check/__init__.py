"""One check as :class:`gradhealth.GradHealth` runs it: what it launches (:mod:`.launch`), the fast paths
of a healthy steady state (:mod:`.steady`, :mod:`.quiet`), the deferred mode (:mod:`.deferred`), what it
carries to the next check (:mod:`.carry`) and saves (:mod:`.state`), and what it does to the step (the
shared clip, :mod:`.clip`; the step guard, :mod:`.skipping`).

Imports: every stage. In the core only the facade (``gradhealth/monitor.py``) imports it.
"""
