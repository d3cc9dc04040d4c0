"""Training: train state, strategies (losses), optimizers, schedules, callbacks, Trainer.

`python -m jrl.train` is the entry point; docs/training.md is the guide.
"""
