"""torchmetrics Metrics for the readings (each with its functional form)."""

from .conservation import ConservationMetric, conservation_summary
from .credit import CreditMetric, credit_readings

__all__ = ["CreditMetric", "credit_readings", "ConservationMetric", "conservation_summary"]
