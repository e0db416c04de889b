"""Elasticity in place: a job that loses a worker trains on with the others, and takes
a new one in at a step boundary, with the same global batches, no process restarted.

    rendezvous.py   the store the workers meet in, which outlives every training node
                    (`spotring rendezvous` serves one), and the generations of members
                    recorded in it
    in_place.py     a rank's part: a collective that failed, the step taken again, the
                    process group formed anew, the state sent to who lacks it

spotring.Job holds an InPlace where spotring.ElasticOptions.in_place asks for it
(docs/elastic.md). Free of torch here: the command's table is imported to list commands.
"""

from spotring.cli import Command

# What this package adds to the `spotring` command (spotring/cli.py).

COMMANDS = {
    "rendezvous": Command("spotring.elastic.rendezvous:main",
                          "serve the store the workers of jobs in place meet in"),
}
