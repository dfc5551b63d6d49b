"""`python -m kvpilot` is the `kvpilot` command."""

import sys

from kvpilot.cli import main

sys.exit(main())
