"""The training configurations, re-exported from the package: `from config import TrainConfig, TrainConfigPretrainLarge`."""

from lowmem.config import TrainConfig, TrainConfigPretrainLarge

__all__ = ["TrainConfig", "TrainConfigPretrainLarge"]
