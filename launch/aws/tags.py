"""The tags on every resource a run creates, and the filters that find them again:

    project           spotring (cfg.project)
    spotring:run-id   the run id
    owner             the caller's ARN (sts get-caller-identity)

`down` finds a run's resources by spotring:run-id; `down --all-mine` finds every run's
by project and owner, whatever this machine remembers.
"""

from __future__ import annotations

from dataclasses import dataclass

RUN_TAG = "spotring:run-id"


@dataclass(frozen=True)
class Tags:
    project: str
    run_id: str
    owner: str

    def items(self) -> list[dict[str, str]]:
        return [{"Key": "project", "Value": self.project},
                {"Key": RUN_TAG, "Value": self.run_id},
                {"Key": "owner", "Value": self.owner},
                {"Key": "Name", "Value": f"spotring-{self.run_id}"}]

    def spec(self, *resource_types: str) -> list[dict]:
        """TagSpecifications: tag at creation, so nothing untagged ever exists."""
        return [{"ResourceType": t, "Tags": self.items()} for t in resource_types]


def run_filter(run_id: str) -> list[dict]:
    return [{"Name": f"tag:{RUN_TAG}", "Values": [run_id]}]


def owner_filter(project: str, owner: str) -> list[dict]:
    return [{"Name": "tag:project", "Values": [project]},
            {"Name": "tag:owner", "Values": [owner]},
            {"Name": "tag-key", "Values": [RUN_TAG]}]


def matches(tags: list[dict] | None, filters: list[dict]) -> bool:
    """``filters`` applied here, for the calls that take no tag filters (describe_fleets)."""
    have = {t["Key"]: t["Value"] for t in tags or []}
    for f in filters:
        if f["Name"] == "tag-key":
            ok = any(k in have for k in f["Values"])
        else:
            ok = have.get(f["Name"].removeprefix("tag:")) in f["Values"]
        if not ok:
            return False
    return True
