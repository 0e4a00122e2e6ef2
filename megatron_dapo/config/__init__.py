"""Typed YAML configuration: schema, loading with overrides, validation, cluster planning."""

from megatron_dapo.config.errors import ConfigError
from megatron_dapo.config.load import apply_override, config_from_dict, config_to_dict, dump_yaml, load_config
from megatron_dapo.config.schema import DapoConfig

__all__ = [
    "ConfigError",
    "DapoConfig",
    "apply_override",
    "config_from_dict",
    "config_to_dict",
    "dump_yaml",
    "load_config",
]
