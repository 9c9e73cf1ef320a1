"""Data: loaders split across the ranks, the resumable sampler, uneven data, and loader state for resume."""
