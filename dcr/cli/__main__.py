"""``python -m dcr.cli``: the ``dcr`` command (the launcher starts fleet roles this way)."""

import sys

from dcr.cli import main

sys.exit(main())
