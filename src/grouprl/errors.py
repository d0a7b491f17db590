"""The one exception type for mistakes a user can fix (bad config, missing file, bad data row)."""


class UserError(Exception):
    """A problem the user caused and can fix; its message names the problem and the fix.

    The CLI prints it as one line on stderr and exits with status 2, without a traceback.
    """
