"""The cluster room: membership, controller, partition assignment and moves (docs/cluster.md)."""
from .room import ClusterError, ClusterRoom

__all__ = ["ClusterError", "ClusterRoom"]
