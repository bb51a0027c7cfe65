"""`python -m jzo.estimate --model gpt2-10b ...`: the memory planner's table
(see jzo.planner, or `--help`)."""

import sys

from jzo.planner import main

if __name__ == "__main__":
  sys.exit(main())
