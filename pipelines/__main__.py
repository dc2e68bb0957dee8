"""`python -m pipelines` is `xmodal`."""

import sys

from pipelines.cli import main

sys.exit(main())
