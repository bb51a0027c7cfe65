"""Model families that jzo's recipes train, above the library.

Nothing under `jzo` outside `jzo.models` and `jzo.recipe` imports this
package: models use the library (`jzo.gather_layer`), never the reverse.
"""
