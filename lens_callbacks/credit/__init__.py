"""Exact credit disintegration of one RL step (pure torch; never imports lightning).

Three folders, three concerns: ``inputs/`` (what goes in: terms, partitions, trajectories),
``engines/`` (the one-pass, forward-mode and reference engines with their per-layer rules), and
``readings/`` (what is read from a report). ``engine.disintegrate`` chooses an engine; ``primitives``
holds what the dispatcher and the engines share; ``report`` is the report they all make.
"""

from .engine import disintegrate, evaluate_terms, resolve_dtype
from .inputs.partition import PARTITIONS, Partition, by_group, by_rollout, by_segment, resolve_partition
from .inputs.terms import CreditSource, CreditTerms, is_credit_source
from .inputs.trajectories import (
    ToolCall,
    Trajectory,
    TrajectoryBatch,
    Turn,
    TurnSegments,
    batch_from_trajectories,
    by_role,
    by_turn,
    turn_claim_support,
    turn_segments,
)
from .readings.conservation import ConservationReading, exact_optimizer_precondition, step_conservation, unit_roundoff
from .readings.table import CreditTable, PartContext, credit_table, part_context
from .report import CreditGrads, CreditReport

# Turn partitions live beside the tokenisation they depend on; register them so
# `partition: by_turn` works by name in YAML.
PARTITIONS.setdefault("by_turn", by_turn)
PARTITIONS.setdefault("by_role", by_role)

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
    "CreditTable",
    "PartContext",
    "credit_table",
    "part_context",
    "step_conservation",
    "exact_optimizer_precondition",
    "ConservationReading",
    "unit_roundoff",
    "Trajectory",
    "Turn",
    "ToolCall",
    "TrajectoryBatch",
    "TurnSegments",
    "batch_from_trajectories",
    "turn_segments",
    "by_turn",
    "by_role",
    "turn_claim_support",
]
