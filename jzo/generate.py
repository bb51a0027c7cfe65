"""`python -m jzo.generate --run DIR | --hf DIR`: text from a trained model, streamed as it
comes (see jzo.recipe.generate, or `--help`)."""

from jzo.recipe.generate import main
from jzo.recipe.quick_exit import quick_exit

if __name__ == "__main__":
  quick_exit(main())
