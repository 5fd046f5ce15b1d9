"""``resihp report``: a run directory's summary and timeline.

Entry points: ``main`` / ``format_summary`` (cli), ``load_run`` (data), ``summarize`` (summary),
``render_timeline`` (plot), ``predicted_times`` (trace).
"""
