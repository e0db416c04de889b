"""cluster=local: a cluster of N "machines" on this one, to run the launcher end to end
with no cloud (as root, with openssh-server installed: `make system-deps`).

    make launch NODES=2 CLUSTER=local ARGS="train.max_steps=120"
    spotring up nodes=2 cluster=local; spotring run; spotring down

Each node is a network namespace with its own address on a bridge (netns.py) and its
own sshd (sshd.py), so every step takes the same path as on EC2: `up` scans the host
keys into the run's known_hosts and writes the hostfiles from the nodes' addresses,
`run` copies the code over ssh into each node's workdir and starts horovodrun on node 0,
which reaches node 1 over ssh; `down` stops what runs in the namespaces and removes
them. The nodes share this machine's filesystem, and its Python is their image: each
builds its .venv on top of it (launch/node_env.py), as an EC2 node does on its AMI's; a
private mount namespace gives each its own workdir, ~/.ssh and /etc/hosts, so what one
node writes there the others do not see.
"""
