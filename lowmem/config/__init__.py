"""The training configuration: typed fields, presets, command-line overrides and up-front validation."""

from lowmem.config.options import apply_overrides, check_data_files, describe_fields, validate_config
from lowmem.config.train_config import (MODEL_SHAPE_FIELDS, RESUME_EXACT_FIELDS, TrainConfig,
                                        TrainConfigPretrainLarge)

__all__ = ["MODEL_SHAPE_FIELDS", "RESUME_EXACT_FIELDS", "TrainConfig", "TrainConfigPretrainLarge", "apply_overrides", "check_data_files", "describe_fields",
           "validate_config"]
