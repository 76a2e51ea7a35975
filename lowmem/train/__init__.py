"""Training: the Trainer of stateful parts, the optimizer step, the schedule, stop signals and the training log."""
