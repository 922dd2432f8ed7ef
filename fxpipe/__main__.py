"""``python -m fxpipe``: the ``fxpipe`` command line."""

from fxpipe.tools.cli import main

raise SystemExit(main())
