"""Where the repository is, for tests that run its scripts and examples."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
