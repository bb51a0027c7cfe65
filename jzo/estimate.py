"""`python -m jzo.estimate --model gpt2-10b ...`: the memory planner's table
(see jzo.recipe.estimate, or `--help`)."""

import sys

from jzo.recipe.estimate import main

if __name__ == "__main__":
  sys.exit(main())
