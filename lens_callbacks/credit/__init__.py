"""Exact credit disintegration of one RL step (pure torch; never imports lightning)."""

from .conservation import ConservationReading, exact_optimizer_precondition, step_conservation, unit_roundoff
from .engine import disintegrate, evaluate_terms, resolve_dtype
from .partition import PARTITIONS, Partition, by_group, by_rollout, by_segment, resolve_partition
from .report import CreditGrads, CreditReport
from .terms import CreditSource, CreditTerms, is_credit_source

__all__ = [
    "CreditTerms",
    "CreditSource",
    "is_credit_source",
    "Partition",
    "PARTITIONS",
    "by_rollout",
    "by_group",
    "by_segment",
    "resolve_partition",
    "disintegrate",
    "evaluate_terms",
    "resolve_dtype",
    "CreditReport",
    "CreditGrads",
    "step_conservation",
    "exact_optimizer_precondition",
    "ConservationReading",
    "unit_roundoff",
]
