"""`python -m cli`: the same as the `ft-train` script."""

import sys

from .main import main

sys.exit(main())
