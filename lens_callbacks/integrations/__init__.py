"""Adapters that bring the audit to training loops other than Lightning's.

Each submodule imports its framework on import and lives behind its own optional extra; importing
``lens_callbacks`` or this package imports none of them.

- :mod:`lens_callbacks.integrations.trl`: TRL's ``GRPOTrainer`` (extra ``trl``).
"""

__all__: list[str] = []
