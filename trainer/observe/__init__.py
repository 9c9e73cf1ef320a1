"""Observing a run: the step timer, the divergence check (detect_divergence) and what turns them on for a fit."""
