"""`python -m hetero ...` runs the `hetero` command."""

import sys

from hetero.cli import main

sys.exit(main())
