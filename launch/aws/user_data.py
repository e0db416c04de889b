"""The script every EC2 node boots with (cloud-init runs it once, as root).

It prepares what `run` needs and an image may lack: the workdir, owned by the SSH user,
and the tools to build the project's .venv there (cluster.setup does that, from the
copied code, after `cloud-init status --wait`).
"""

from __future__ import annotations

import shlex

SCRIPT = """\
#!/bin/bash
# spotring node preparation (cloud-init user data)
set -euxo pipefail
install -d -o {user} -g {user} {workdir}
if command -v apt-get > /dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends make python3-venv python3-dev \\
        build-essential cmake
fi
"""


def render(user: str, workdir: str) -> str:
    return SCRIPT.format(user=shlex.quote(user), workdir=shlex.quote(workdir))
