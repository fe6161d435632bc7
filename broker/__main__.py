"""``python -m broker serve ...`` runs the same command line as ``s3kafka``."""
import sys

from .cli import main

sys.exit(main())
