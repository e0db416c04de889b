"""Spot prices, from EC2's spot price history: the price in effect now, per type and zone.

On-demand prices are not in the EC2 API (they are in the Pricing API, one region only);
`cost` reports on-demand nodes without a price rather than guess one.
"""

from __future__ import annotations

from datetime import datetime, timezone


def spot_prices(ec2, types: list[str], zones: list[str] | None = None
                ) -> dict[tuple[str, str], float]:
    """{(instance type, zone): $/hour}; with StartTime=now AWS gives the current price."""
    latest: dict[tuple[str, str], tuple[datetime, float]] = {}
    pages = ec2.get_paginator("describe_spot_price_history").paginate(
        InstanceTypes=types, ProductDescriptions=["Linux/UNIX"],
        StartTime=datetime.now(timezone.utc))
    for page in pages:
        for p in page["SpotPriceHistory"]:
            key = (p["InstanceType"], p["AvailabilityZone"])
            if zones and key[1] not in zones:
                continue
            if key not in latest or p["Timestamp"] > latest[key][0]:
                latest[key] = (p["Timestamp"], float(p["SpotPrice"]))
    return {key: price for key, (_, price) in latest.items()}
