"""The plan room: pure functions from a recipe and a cluster to configs and commands."""

from llmtune.plan.cluster import Cluster, make_cluster
from llmtune.plan.planner import Plan, make_plan

__all__ = ["Cluster", "Plan", "make_cluster", "make_plan"]
