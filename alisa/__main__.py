"""``python -m alisa`` (and ``torchrun -m alisa``) runs the CLI."""

import sys

from alisa.cli import main

sys.exit(main())
