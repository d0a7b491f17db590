"""Running programs a model wrote, safely, on this machine (bubblewrap).

`check(program, tests)` runs a program against stdin/stdout cases, assert statements or a
checker function and gives one verdict per test; `run(program, stdin)` runs it once and gives
its output; `available()` says whether the sandbox can run here. What a sandbox holds and why:
`grouprl.sandbox.runtime` (the process), `grouprl.sandbox.slots` (sandboxes kept between
programs) and `grouprl.sandbox.harness` (the verdicts).
"""

from grouprl.sandbox.pool import check_many
from grouprl.sandbox.run import KINDS, Limits, Ran, Tests, Verdict, check, run
from grouprl.sandbox.runtime import Unavailable

__all__ = ["KINDS", "Limits", "Ran", "Tests", "Unavailable", "Verdict", "available", "check",
           "check_many", "run"]  # fmt: skip


def available() -> str | None:
    """None when the sandbox runs here; else why not, in one line."""
    from grouprl.sandbox.pool import probe

    return probe()
