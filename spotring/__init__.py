"""spotring: synchronous data-parallel PyTorch training on clusters of spot GPU instances.

The ``spotring`` command (spotring/cli.py) fronts the three parts, each a package of
its own: trainer/ (what runs on every rank), launch/ (nodes up, the job across them,
nodes down) and benchmarks/ (scaling measurements and the predictor); conf/ holds the
Hydra configuration they compose.
"""
