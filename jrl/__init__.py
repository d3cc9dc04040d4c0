"""jrl: JAX-native training and RL post-training of decoder-only language models."""

__version__ = "0.1.0"
