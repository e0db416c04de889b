"""cluster=aws_spot: EC2 spot instances for one run, and nothing left after it.

    make launch NODES=8 ARGS="dataset=cifar10 model=resnet20 train.epochs=30"
    spotring up nodes=8 cluster.instance_types=[g5.12xlarge,g6.12xlarge]
    spotring down            # the newest run; `down --all-mine` for strays

provider.py ties the pieces together: checks.py (read-only, before anything exists),
resources.py (key pair, security group, placement group, launch template; deletion in
dependency order), fleet.py (instant fleets, all or nothing, type by type and zone by
zone), instances.py (waiting, describing), tags.py, prices.py, user_data.py; clients.py
makes every boto3 client (adaptive retries). boto3 honours AWS_ENDPOINT_URL, which is
how the tests point all of it at moto.
"""
