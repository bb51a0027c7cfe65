"""jzo's recipes: training, export and estimates of the models in jzo.models.

The top layer: it uses the library (the engine, the planner, checkpoints)
and the model families; neither imports it.
"""
