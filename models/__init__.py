"""Model definitions used by jzo's recipes and experiments."""
