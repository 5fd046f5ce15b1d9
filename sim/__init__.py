"""Cluster-scale, event-driven simulation of resilience policies."""
