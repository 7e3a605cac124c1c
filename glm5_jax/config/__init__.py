"""Every configuration class of the project, in one place: frozen dataclasses, YAML loading, `key=value`
overrides and validation whose errors name the field, the offending value and what would be valid.

`core` holds the model, train, data and checkpoint sections and the generic loader; the other sections each
have their own module (`mesh`, `optim`, `rl`, `distributed`, `async_rl`) and `experiment` puts them together.
This package imports nothing else from glm5_jax: it is the bottom layer.
"""

from glm5_jax.config.core import (ATTENTION_BACKENDS, DTYPES, INDEXER_TYPES, MOE_BACKENDS, NON_FINITE_POLICIES,
                                  PALLAS_PLATFORMS, REMAT_POLICIES, TRAIN_MODES, CheckpointConfig, ConfigError,
                                  DataConfig, ModelConfig, TrainConfig, _deep_update, _fail, apply_overrides,
                                  from_dict, parse_overrides, load_model_config, load_yaml, model_config_from_dict,
                                  model_config_from_hf, require_finite_floats, to_dict)

__all__ = ["ATTENTION_BACKENDS", "DTYPES", "INDEXER_TYPES", "MOE_BACKENDS", "NON_FINITE_POLICIES",
           "PALLAS_PLATFORMS", "REMAT_POLICIES", "TRAIN_MODES", "CheckpointConfig", "ConfigError", "DataConfig",
           "ModelConfig", "TrainConfig", "_deep_update", "_fail", "apply_overrides", "from_dict",
           "load_model_config", "load_yaml", "model_config_from_dict", "model_config_from_hf", "parse_overrides",
           "require_finite_floats", "to_dict"]
