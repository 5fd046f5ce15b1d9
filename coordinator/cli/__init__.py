"""The coordinator's command-line tools, each a ``main(argv) -> int``: ``resihp admin`` (admin),
``resihp detect`` (detect), ``resihp plan`` (plan) and ``resihp profile`` (profile).
"""
