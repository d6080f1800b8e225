"""Rank-1 weight-trajectory projection for a delayed anchor (pure torch/numpy; never imports lightning).

- :class:`GrowingWeightTrajRing`: base snapshot, fp32 consecutive deltas, float64 Gram (d-independent storage).
- :class:`Rank1TrajProjector`: eigh of the window Gram, OLS on real ticks, de-stale, ``θ̂`` in the snapshot span,
  per-block coherence gate against the random-walk null.
- :func:`signed_ema`, :func:`projected_merge`: the mergers of the fast gradient with ``sign(M_anchor)``.
- :func:`replay`: the offline gate over saved weights.
"""

from .fit import Rank1Fit, destale, evr1_null_limit, evr1_null_quantile, fit_rank1, ols
from .gate import GateReport, load_checkpoints, replay
from .merger import confidence_weights, ema_update, projected_merge, signed_ema
from .projector import AnchorReading, Projection, Rank1TrajProjector, block_of, trust
from .ring import GrowingWeightTrajRing, prefix_gram, rebase_gram

__all__ = [
    "GrowingWeightTrajRing",
    "prefix_gram",
    "rebase_gram",
    "Rank1Fit",
    "fit_rank1",
    "ols",
    "destale",
    "evr1_null_limit",
    "evr1_null_quantile",
    "Rank1TrajProjector",
    "AnchorReading",
    "Projection",
    "block_of",
    "trust",
    "signed_ema",
    "projected_merge",
    "confidence_weights",
    "ema_update",
    "GateReport",
    "replay",
    "load_checkpoints",
]
