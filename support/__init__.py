"""What the trainer, the launchers, the sweeps and the reports share and a user's script
never calls: the restart policy every launcher applies to a job's exit (restarts.py),
Hydra's composition of spotring's own configs (compose.py), the ``checkpoint.uri`` node
of the launchers' configs (checkpoint.py), and the plots' headless matplotlib
(plotting.py). It stands on the library (spotring/), never the other way.
"""
