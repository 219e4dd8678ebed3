"""Error classes shared by the loop and the modules below it (reported as one line by the CLI)."""


class ConfigError(ValueError):
    """A configuration that cannot run (reported as one line, exit status 2)."""
