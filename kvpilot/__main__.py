"""`python -m kvpilot` is the `kvpilot` command."""

import sys

from kvpilot.cli.main import main

sys.exit(main())
