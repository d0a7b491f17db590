"""`python -m grouprl ...`: the same as the `grouprl` command."""

import sys

from grouprl.cli import main

sys.exit(main())
