"""Where a run's numbers go: JSONL files, the trackers (TensorBoard, W&B, trackio, MLflow), and
PNG plots."""

from grouprl.report.plots import plot_run
from grouprl.report.sinks import JsonlWriter, MetricSinks

__all__ = ["JsonlWriter", "MetricSinks", "plot_run"]
