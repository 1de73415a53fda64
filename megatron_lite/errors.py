"""The error a user's bad flag or flag combination raises (the CLI prints it in one line, exit 2)."""


class ConfigError(ValueError):
    """A bad flag or flag combination; the message names the flag and the fix."""
