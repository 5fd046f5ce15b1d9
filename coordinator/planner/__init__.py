"""Joint TP / PP / DP re-planning around failed and slow devices.

Entry points: ``search`` / ``search_plan`` / ``simulate_plan`` (planner), ``decide`` (decision: the
ski-rental rule over the escalation ladder), ``evaluate`` / ``PlannerConfig`` (cost), ``Profile`` /
``ProfileFitter`` (profile: speeds measured from the job), ``PlanAudit`` (audit: did a re-plan pay
off). Pure: no torch, grpc or MPI.
"""
