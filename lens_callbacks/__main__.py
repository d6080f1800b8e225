import sys

from .cli import main

# Usage lines name the command a user types, not ``__main__.py``.
sys.argv[0] = "lens-callbacks"

raise SystemExit(main())
