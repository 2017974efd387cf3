"""`python -m hetero ...` runs the `hetero` command."""

import sys

from hetero.cli.main import main

sys.exit(main())
