"""RL post-training on top of jrl.train and jrl.rollout: tasks and rewards, the rollout
source that feeds the trainer, advantages, evaluation, the warm start, and the learner
that hands a Trainer these roles. Imports flow one way: jrl.rl uses jrl.train and
jrl.rollout; neither imports jrl.rl."""

from jrl.rl.learner import Learner, build_learner
from jrl.rl.options import RLOptions

__all__ = ["Learner", "RLOptions", "build_learner"]
