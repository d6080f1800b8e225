"""torchmetrics Metrics for the readings (each with its functional form)."""

from .anchor import GatedOnFraction, WeightPredictionError, gated_on_fraction, weight_prediction_error
from .conservation import ConservationMetric, conservation_summary
from .credit import CreditMetric, credit_readings
from .probe import ProbeCreditMetric, probe_summary
from .process import ProcessRewardMetric, process_reward_stats

__all__ = [
    "CreditMetric",
    "credit_readings",
    "ConservationMetric",
    "conservation_summary",
    "ProbeCreditMetric",
    "probe_summary",
    "ProcessRewardMetric",
    "process_reward_stats",
    "WeightPredictionError",
    "GatedOnFraction",
    "weight_prediction_error",
    "gated_on_fraction",
]
