"""``python -m fxpipe``: the ``fxpipe`` command line."""

from fxpipe.cli import main

raise SystemExit(main())
