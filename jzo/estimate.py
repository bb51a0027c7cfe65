"""`python -m jzo.estimate --model gpt2-10b ...`: the memory planner's table
(see jzo.recipe.estimate, or `--help`)."""

from jzo.quick_exit import quick_exit
from jzo.recipe.estimate import main

if __name__ == "__main__":
  quick_exit(main())
