"""python -m torchpar.plan --help (the command line is torchpar.plan.cli: spawned ranks import it from there)."""
import sys

from torchpar.plan.cli import main

sys.exit(main())
