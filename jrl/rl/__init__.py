"""Reinforcement-learning pieces of jrl."""
