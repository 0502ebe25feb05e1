"""`python -m specdistill.cli ...` (and `torchrun ... -m specdistill.cli distill ...`)."""

import sys

from specdistill.cli import main

if __name__ == "__main__":
    sys.exit(main())
