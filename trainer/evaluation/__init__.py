"""Evaluation and metrics: validation / test / predict steps, what `self.log` records, and metric objects."""
