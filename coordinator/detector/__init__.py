"""Fail-stop and fail-slow detection against what each iteration should have cost.

Entry points: ``Detector`` (detector), ``DetectorConfig`` (config), ``Finding`` / ``RankState``
(verdicts). The predictor, the evidence arrays, compiled schedules, the per-iteration judge and
the probe and idle-rank verdicts are its parts. Pure: no torch, grpc or MPI.
"""
