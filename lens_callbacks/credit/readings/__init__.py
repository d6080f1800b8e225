"""Readings made from an engine's report: concentration (``summaries``), stable-name partitions
(``derived``), the noise scale (``noise``), the run ledger (``ledger``), update shares
(``update_share``), the per-step bundle a callback logs (``step_readings``), the credit table
(``table``), step conservation (``conservation``, ``mismatch``), global readings under DDP
(``distributed``) and credit toward a probe objective (``probe``).

The engines that make the report live in :mod:`lens_callbacks.credit.engines`; the public names are
exported from :mod:`lens_callbacks.credit`.
"""
