"""``python -m hetfed.cli``."""

import sys

from hetfed.cli import main

sys.exit(main())
