"""The one exception type for mistakes a user can fix (bad config, missing file, bad data row)."""


class UserError(Exception):
    """A problem the user caused and can fix; its message names the problem and the fix.

    The CLI prints it as one line on stderr and exits with status 2, without a traceback. The
    message is one line whatever it quotes: a newline in a user's value shows as ``\\n``.
    """

    def __str__(self) -> str:
        return super().__str__().replace("\r", "\\r").replace("\n", "\\n")
