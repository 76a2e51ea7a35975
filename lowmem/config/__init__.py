"""The training configuration: typed sections, fields declared with their help and bounds, presets as data,
command-line overrides and up-front validation.

    TrainConfig                 every section at once (DataConfig, MemoryConfig, TokenizerConfig, ModelConfig,
                                OptimConfig, OutputConfig, EvalConfig); flat: `config.batch_size_per_gpu`
    PRESETS, TrainConfigPretrainLarge   named sets of defaults, and the class built from PRESETS["large"]
    option()                    how a field is declared: default, help, bounds, choices, resume role, aliases
    apply_overrides, validate_config, describe_fields, with_demo_data
"""

from lowmem.config.demo import DEMO_DATA_DIR, with_demo_data
from lowmem.config.option import OptionSpec, option, spec_of
from lowmem.config.overrides import apply_overrides, describe_fields, given_fields
from lowmem.config.validation import validate_config
from lowmem.config.sections import (DataConfig, EvalConfig, MemoryConfig, ModelConfig, OptimConfig, OutputConfig,
                                    TokenizerConfig)
from lowmem.config.train_config import (MODEL_SHAPE_FIELDS, PRESETS, RESUME_EXACT_FIELDS, TrainConfig,
                                        TrainConfigPretrainLarge)

__all__ = [
    "DEMO_DATA_DIR", "MODEL_SHAPE_FIELDS", "PRESETS", "RESUME_EXACT_FIELDS", "DataConfig", "EvalConfig", "MemoryConfig",
    "ModelConfig", "OptimConfig", "OptionSpec", "OutputConfig", "TokenizerConfig", "TrainConfig",
    "TrainConfigPretrainLarge", "apply_overrides", "describe_fields", "given_fields", "option", "spec_of",
    "validate_config", "with_demo_data",
]
