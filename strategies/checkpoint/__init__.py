"""The checkpoint component: the one place that knows the format and reads and writes it, for the Trainer's
checkpoints and a plain loop's `strategy.save` / `strategy.load` alike (docs/architecture.md, "Checkpoints").

- the contract with the owners of state (`state_dict` / `load_state_dict`, as torch's Stateful): stateful.py
- saving and loading a map of owners, one way down: checkpointer.py; whether a checkpoint fits: compatibility.py
- the format: a DCP directory plus our integrity metadata (format.py), written by every rank in parallel and
  atomically (writer.py, files.py, planners.py), read by each rank in the pieces it needs (source.py), objects
  unpickled under an allow-list (unpickling.py); errors every rank raises alike (errors.py)
- a plain loop's checkpoints: plain_loop.py
- in one process: the whole checkpoint or its model state dict (whole.py); out to one plain file and to
  safetensors, weights in from safetensors (export.py, streamed_file.py); the command line (command.py)
"""
