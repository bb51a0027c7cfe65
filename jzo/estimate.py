"""`python -m jzo.estimate --model gpt2-10b ...`: the memory planner's table
(see jzo.recipe.estimate, or `--help`).

`jzo.estimate` is also the planner function (jzo.plan.fit): importing
this module would put the module in its place on the package, so the module
itself calls that function, and `jzo.estimate(...)` means the same either
way."""

import sys
import types

from jzo.plan.fit import estimate
from jzo.recipe.estimate import main
from jzo.recipe.quick_exit import quick_exit


class _CallableModule(types.ModuleType):
  def __call__(self, *args, **kwargs):
    return estimate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
__doc__ = f"{__doc__}\n\n{estimate.__doc__}"

if __name__ == "__main__":
  quick_exit(main())
