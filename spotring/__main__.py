"""python -m spotring: the same as the ``spotring`` command."""

import sys

from spotring.cli import main

sys.exit(main())
