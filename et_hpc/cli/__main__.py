"""``python -m et_hpc.cli``: the same as the ``et-hpc`` command."""

import sys

from et_hpc.cli.app import main

sys.exit(main())
