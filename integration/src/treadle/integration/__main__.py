"""``python -m treadle.integration ...``: the same as ``treadle-launch ...``."""

import sys

from treadle.integration.cli import main

sys.exit(main())
