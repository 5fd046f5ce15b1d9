"""What crosses the wire between hooks, agents and the coordinator.

Entry points: the frozen dataclasses of ``messages``, the one protobuf boundary ``codec``, the
packed rank reports of ``wire`` (the hot path) and the job token and TLS of ``auth``.
"""
