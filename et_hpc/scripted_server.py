"""Moved to ``et_hpc.testing.scripted_server``; this path forwards names until the release that
``et_hpc.compat.COMPAT`` gives."""

import sys

from et_hpc._moved import forward

__getattr__ = forward("et_hpc.testing.scripted_server")

if __name__ == "__main__":  # python -m et_hpc.scripted_server
    from et_hpc.testing.scripted_server import main

    sys.exit(main())
