"""``python -m rrtod`` runs the daemon."""

import sys

from rrtod.daemon import main

sys.exit(main())
