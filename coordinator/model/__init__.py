"""The shared vocabulary every pure module speaks: model shapes, plans, clusters, cost and
memory, traces.

Entry points: ``ModelSpec`` / ``preset`` (spec), ``Plan`` (plan), ``Cluster`` / ``GlobalBatch``
(cluster), ``stage_flops`` / ``LinearCost`` (costmodel), ``MemoryModel`` (memory), the trace
format's records with ``read_trace`` / ``write_trace`` (trace). Pure: no torch, grpc or MPI.
"""
