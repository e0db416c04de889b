"""The one place the launcher's boto3 clients are made, with spotring/stores/aws.py's retries
(AWS_MAX_ATTEMPTS and AWS_RETRY_MODE, where set, as they are when the client is made)."""

from __future__ import annotations

import boto3

from spotring.stores.aws import retries


def session(region: str) -> boto3.session.Session:
    """Credentials as boto3 finds them (AWS_PROFILE, the variables, ~/.aws); boto3
    honours AWS_ENDPOINT_URL, which is how the tests point every client at moto."""
    return boto3.session.Session(region_name=region)


def client(session: boto3.session.Session, service: str):
    return session.client(service, config=retries())
