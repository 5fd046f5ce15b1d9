"""Asynchronous full-state checkpoints that load into any plan (docs/checkpoint.md).

Entry points: ``AsyncCheckpointer`` / ``load_into`` / ``restore_live`` (saver) and the on-disk
format (format: pure).
"""
