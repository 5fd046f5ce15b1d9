"""Where a rank's step reports go: the agent client, the reporter behind one small interface,
and the trace a real run records.

Entry points: ``AgentClient`` (agent_client), ``connect`` / ``Transport`` (reporter),
``TraceCollector`` (trace_writer).
"""
