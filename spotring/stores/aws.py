"""How spotring configures its AWS clients, the trainer's (S3 checkpoints) and the
launcher's (EC2, STS, SSM) alike: botocore's adaptive retry mode.

Adaptive is botocore's standard retry (throttling, 5xx and connection errors, with
exponential backoff and jitter) plus a client-side rate limit that slows the calls down
once AWS throttles them: a launch polls describe calls for many nodes at once, and AWS
throttles an account's API calls across all of its users.

AWS's own variables AWS_RETRY_MODE and AWS_MAX_ATTEMPTS (attempts in all, the first
included), where set, take the place of these defaults, as they do for the AWS CLI.
"""

from __future__ import annotations

import os

from botocore.config import Config

# Attempts in all, the first included. The waits between them double from up to 1 s and
# are capped at 20 s, so the last try comes at most about two minutes after the first:
# longer than a burst of throttling lasts.
MAX_ATTEMPTS = 10


def retries() -> Config:
    """The retry config for a client made now. botocore reads AWS_RETRY_MODE and
    AWS_MAX_ATTEMPTS only for what a client's config leaves out, so a set variable
    leaves its setting to botocore."""
    settings = {"mode": "adaptive", "total_max_attempts": MAX_ATTEMPTS}
    if "AWS_RETRY_MODE" in os.environ:
        del settings["mode"]
    if "AWS_MAX_ATTEMPTS" in os.environ:
        del settings["total_max_attempts"]
    return Config(retries=settings)

