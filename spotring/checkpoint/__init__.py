"""Checkpoints: what they are in a store, how a job's ranks save and restore them, and the
one adapter to torch's distributed checkpoint.

    layout.py    what a checkpoint is in any store: the names of its folder of parts and
                 its manifest, the format, verification, finding the newest valid one
                 (torch-free: launchers, sweeps and benchmarks read it)
    manager.py   the Checkpointer a spotring.Job holds: what a checkpoint holds, and the
                 save and the restore, each top to bottom
    parts.py     every rank's part through torch.distributed.checkpoint: written, staged
                 for a background save, read on any world size, or read whole

The manager stands on the other two, which never call back into it. This package imports
nothing itself: ``import spotring.checkpoint.layout`` loads no torch.
"""
