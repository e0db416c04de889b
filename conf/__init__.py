"""spotring's Hydra configuration: config.yaml (the trainer) and launch.yaml (the
launcher), with their groups. A package only so that it ships inside the wheel and
Hydra finds it as ``pkg://spotring.conf`` wherever spotring is installed."""
