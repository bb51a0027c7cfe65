"""Model families that jzo's recipes train, above the library.

Nothing under `jzo` outside `jzo.models` and `jzo.recipe` imports this
package: models use the library (`jzo.gather_layer`), never the reverse.
"""

import importlib
import sys

# flax.nnx asks at import whether it runs under IPython by importing IPython,
# which costs every command 0.5 s; where IPython is not loaded yet the answer
# is no, so the import is refused (ImportError: flax's own "no") while flax
# loads. Under IPython or Jupyter, where it is loaded, nothing changes.
if "IPython" not in sys.modules:
  sys.modules["IPython"] = None
  try:
    importlib.import_module("flax.nnx")
  finally:
    del sys.modules["IPython"]
