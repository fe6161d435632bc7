"""``s3kafka cluster describe``: cluster id, controller and brokers (DescribeCluster)."""
from __future__ import annotations

import argparse
from typing import Any

from .common import Family, Result, table


def register(families: Any, common: argparse.ArgumentParser) -> None:
    fam = Family(families, common, "cluster", help="describe the cluster",
                 description="Cluster-wide information.")
    fam.action("describe", describe_cluster, help="cluster id, controller, brokers")


def describe_cluster(args: argparse.Namespace, admin: Any) -> Result:
    info = admin.describe_cluster()
    brokers = sorted(({"node_id": b["broker_id"], "host": b["host"], "port": b["port"],
                       "rack": b.get("rack")} for b in info["brokers"]),
                     key=lambda b: b["node_id"])
    data = {"cluster_id": info["cluster_id"], "controller_id": info["controller_id"],
            "brokers": brokers}
    lines = [f"Cluster ID: {info['cluster_id']}", f"Controller: {info['controller_id']}", ""]
    lines += table(["NODE-ID", "HOST", "PORT", "RACK"],
                   [(b["node_id"], b["host"], b["port"], b["rack"]) for b in brokers])
    return Result(data, lines)
