"""``python -m jobq`` for the installed package (the wheel maps jobq.py to jobq/__init__.py)."""

import sys

from jobq import main

sys.exit(main())
