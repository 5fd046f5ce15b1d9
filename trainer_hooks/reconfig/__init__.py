"""Live reconfiguration: agree on the switch step, reshard parameters and optimizer state
between plans, and recover from a fail-stop (ULFM shrink, a fresh gloo world).

Entry points: ``LiveReconfigurer`` (live), ``BoundaryAgreement`` (agreement), ``plan_reshard``
(reshard: pure), ``reshard_state`` / ``start_reshard`` (transfer), ``recover`` (failstop, ulfm).
"""
