"""The training loop: epochs and one training batch, optimizers and schedulers, precision, non-finite values, and
what the ranks agree on after each training_step."""
