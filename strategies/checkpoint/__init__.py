"""Checkpoints in the project's format: a torch Distributed Checkpoint (DCP) directory plus our integrity metadata
(format.py), written by every rank in parallel and atomically (writer.py, files.py), read by each rank in the
pieces it needs (source.py, planners.py); the model and optimizers in them by parameter name (model_state.py).
The Trainer's checkpoints (trainer/checkpoint/) and a plain loop's `strategy.save` / `strategy.load`
(loop_state.py) are both written and read through these."""
