"""torchmetrics Metrics for the readings."""
