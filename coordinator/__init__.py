"""Decisions: cost model, schedule simulator, detector, planner (pure) and the service around them."""
