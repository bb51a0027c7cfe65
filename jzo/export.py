"""`python -m jzo.export --run DIR --out DIR`: a run's trained weights as a
Hugging Face folder or jzo's own form (see jzo.recipe.export, or `--help`)."""

from jzo.recipe.export import main
from jzo.recipe.quick_exit import quick_exit

if __name__ == "__main__":
  quick_exit(main())
