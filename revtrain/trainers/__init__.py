"""Trainers: the memory-efficient reversible trainer and the standard backprop reference."""

from revtrain.trainers.common import NonFiniteError, TrainerBase, TrainerError, TrainState
from revtrain.trainers.layerwise import CoupledUpdateError, LayerwiseUpdate
from revtrain.trainers.reversible import ReversibleTrainer
from revtrain.trainers.standard import StandardTrainer

__all__ = ["ReversibleTrainer", "StandardTrainer", "TrainState", "TrainerBase", "TrainerError", "NonFiniteError",
           "LayerwiseUpdate", "CoupledUpdateError"]
