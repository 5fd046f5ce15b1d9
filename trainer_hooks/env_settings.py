"""What the two hook calls read from the environment, parsed and checked: the throttle a job
injects without an agent (``RESIHP_THROTTLE``), an idle rank's probe interval
(``RESIHP_PROBE_EVERY_S``), the trace file (``RESIHP_TRACE``). A malformed value is a
``SpecError`` naming the variable and the expected form, at ``init``, before any rank
allocates memory."""
from __future__ import annotations

import math
import os

from resihp.coordinator.model.spec import SpecError

PROBE_ENV = "RESIHP_PROBE_EVERY_S"  # seconds between an idle spare's compute probes
THROTTLE_ENV = "RESIHP_THROTTLE"  # "RANK:FACTOR[@ITER[-UNTIL]][,…]": inject a fail-slow without an agent
TRACE_ENV = "RESIHP_TRACE"


def parse_throttle_env(text: str, rank: int) -> tuple[float, int, int | None] | None:
    """This rank's (factor, from_iteration, until_iteration or None) in a RESIHP_THROTTLE
    value, or None. ``-UNTIL``: the device is back to full speed from that iteration on."""
    for item in filter(None, (p.strip() for p in text.split(","))):
        try:
            who, rest = item.split(":", 1)
            factor_s, _, span = rest.partition("@")
            at_s, dash, until_s = span.partition("-")
            until = int(until_s) if dash else None
            at = int(at_s or 0)
            if until is not None and until <= at:
                raise ValueError
            if int(who) == rank:
                return float(factor_s), at, until
        except ValueError:
            raise SpecError(f"{THROTTLE_ENV}={text!r}: expected RANK:FACTOR[@ITER[-UNTIL]] with UNTIL after ITER, "
                            "e.g. 3:2.0@10 or 3:2.0@10-20") from None
    return None


def probe_interval(value: float | None) -> float:
    """``init``'s probe_every_s, else $RESIHP_PROBE_EVERY_S, else 30 s; validated."""
    text = os.environ.get(PROBE_ENV, "").strip()
    try:
        every = value if value is not None else (float(text) if text else 30.0)
    except ValueError:
        raise SpecError(f"{PROBE_ENV}={text!r}: expected seconds between an idle rank's probes, e.g. 30") from None
    if not (math.isfinite(every) and every > 0):
        raise SpecError(f"init: probe_every_s must be a finite number of seconds > 0, got {every!r}")
    return float(every)
