"""The cluster side of spotring: start nodes, write hostfiles, run the trainer across
them, tear them down (python -m launch). launch.commands also builds the local
launcher commands that the Makefile, tests and benchmarks use."""
