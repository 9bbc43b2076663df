"""The user-facing error base class: the CLI prints these as one line, services map them to a status."""


class SpecserveError(Exception):
    """An error caused by input (flags, request fields, checkpoints), not by a bug."""
