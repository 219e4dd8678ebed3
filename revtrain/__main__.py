"""``python -m revtrain`` runs the command line."""

import sys

from revtrain.cli import main

sys.exit(main())
