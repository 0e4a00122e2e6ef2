"""The one exception type of the config system."""


class ConfigError(ValueError):
    """A config that cannot be used; the message names the offending key(s) on one line."""
