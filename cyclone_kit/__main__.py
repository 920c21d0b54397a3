"""``python -m cyclone_kit``: the command-line interface."""

import sys

from cyclone_kit.cli.app import main

sys.exit(main())
