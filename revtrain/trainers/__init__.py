"""Trainers: the memory-efficient reversible trainer and the standard backprop reference."""

from revtrain.trainers.common import NonFiniteError, TrainerBase, TrainerError, TrainState, check_per_layer_optimizer
from revtrain.trainers.reversible import ReversibleTrainer
from revtrain.trainers.standard import StandardTrainer

__all__ = ["ReversibleTrainer", "StandardTrainer", "TrainState", "TrainerBase", "TrainerError", "NonFiniteError",
           "check_per_layer_optimizer"]
