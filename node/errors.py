"""The node's exception tree."""


class SegnodeError(Exception):
    """Base of the node's own errors."""


class ConfigError(SegnodeError):
    """The configuration is invalid; the message names the key."""


class JobError(SegnodeError):
    """A job cannot be completed; the message is the reason shown to the admin."""


class ResultError(SegnodeError):
    """A SEG or SR cannot be built or does not reproduce the result; the message says why."""


class NoSegmentsError(ResultError):
    """The label map has no labelled voxel: there is nothing to encode."""
