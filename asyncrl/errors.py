"""Errors the user caused and can fix (bad config, missing model dir, malformed dataset row).

The CLI prints these as one line without a traceback; everything else is a bug and keeps its
traceback. Subclasses of ValueError so library callers can catch them the ordinary way.
"""


class UserError(ValueError):
    """A problem in the user's input; the message names the file/field and what is allowed."""


class JobFailed(RuntimeError):
    """A job stopped by a failure outside the user's input (a lost node, a dead process); the
    message says what happened and how to go on, so the CLI prints it without a traceback."""
