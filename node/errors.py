"""The node's exception tree."""


class SegnodeError(Exception):
    """Base of the node's own errors."""


class ConfigError(SegnodeError):
    """The configuration is invalid; the message names the key."""


class JobError(SegnodeError):
    """A job cannot be completed; the message is the reason shown to the admin."""
