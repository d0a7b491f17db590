"""The one exception type for mistakes a user can fix (bad config, missing file, bad data row)."""


class UserError(Exception):
    """A problem the user caused and can fix; its message names the problem and the fix.

    The CLI prints it as one line on stderr and exits with status 2, without a traceback. The
    message is one line whatever it quotes: a newline in a user's value shows as ``\\n``.
    """

    def __str__(self) -> str:
        return super().__str__().replace("\r", "\\r").replace("\n", "\\n")


def one_line(err: BaseException) -> str:
    """A library's exception as one line for a UserError message: its type and the first line
    of its text. An exception that only wraps another (a message that says nothing but that
    something failed, as datasets' DatasetGenerationError does) is described by its cause."""
    cause = err.__cause__
    if cause is not None and type(err).__name__.endswith("GenerationError"):
        err = cause
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0].strip() if lines else ''}".rstrip(": ")
