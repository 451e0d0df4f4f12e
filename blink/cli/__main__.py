"""`python -m blink.cli`: the `blink` command."""

import contextlib

from blink.cli import main

with contextlib.suppress(KeyboardInterrupt):
    raise SystemExit(main())
