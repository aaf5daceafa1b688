"""``python -m sim``: run one simulated vLLM engine."""

import sys

from sim.cli import main

sys.exit(main())
