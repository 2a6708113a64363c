"""`python -m services.cli`: the `verst` command."""

import sys

from services.cli.app import main

sys.exit(main())
