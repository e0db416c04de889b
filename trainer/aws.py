"""How spotring configures its AWS clients, the trainer's (S3 checkpoints) and the
launcher's (EC2, STS, SSM) alike: botocore's adaptive retry mode.

Adaptive is botocore's standard retry (throttling, 5xx and connection errors, with
exponential backoff and jitter) plus a client-side rate limit that slows the calls down
once AWS throttles them: a launch polls describe calls for many nodes at once, and AWS
throttles an account's API calls across all of its users.
"""

from __future__ import annotations

from botocore.config import Config

# Attempts in all, the first included. The waits between them double from up to 1 s and
# are capped at 20 s, so the last try comes at most about two minutes after the first:
# longer than a burst of throttling lasts.
MAX_ATTEMPTS = 10
RETRIES = Config(retries={"mode": "adaptive", "max_attempts": MAX_ATTEMPTS})
