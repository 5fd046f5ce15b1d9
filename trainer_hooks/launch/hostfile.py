"""Open MPI hostfiles, for ``resihp launch --hostfile``: which node every rank lands on.

The format is Open MPI's: one node per line, ``NAME [slots=N]`` (``slots`` defaults to 1),
``#`` starts a comment. ``resihp launch`` starts the ranks with ``--map-by slot``, which
fills each node's slots in file order before the next node, so rank ``r``'s node follows
from the file alone — the coordinator needs that map before any rank exists (the
detector localises a slow link to a node). A job larger than the slots is refused rather
than oversubscribed: Open MPI then spreads the extra ranks in an order this map cannot
predict.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_SLOTS = re.compile(r"^slots=(\d+)$")


class HostfileError(ValueError):
    """A hostfile that cannot describe the job; the message says what to change."""


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


def parse_hostfile(text: str, source: str = "hostfile") -> tuple[Host, ...]:
    hosts: list[Host] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *opts = line.split()
        slots = 1
        for opt in opts:
            m = _SLOTS.match(opt)
            if m is None:
                raise HostfileError(f"{source}:{lineno}: unsupported option {opt!r} (give 'NAME slots=N')")
            slots = int(m.group(1))
            if slots < 1:
                raise HostfileError(f"{source}:{lineno}: slots must be >= 1, got {slots}")
        if any(h.name == name for h in hosts):
            raise HostfileError(f"{source}:{lineno}: node {name!r} is listed twice (give it once, with all its slots)")
        hosts.append(Host(name, slots))
    if not hosts:
        raise HostfileError(f"{source}: no nodes listed (one 'NAME slots=N' line per node)")
    return tuple(hosts)


def read_hostfile(path: str | Path) -> tuple[Host, ...]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise HostfileError(f"cannot read the hostfile {path}: {exc.strerror or exc}") from None
    return parse_hostfile(text, str(path))


def rank_nodes(hosts: tuple[Host, ...], n: int) -> tuple[str, ...]:
    """The node of every rank under ``--map-by slot``: nodes filled in file order."""
    total = sum(h.slots for h in hosts)
    if n > total:
        raise HostfileError(f"-n {n} ranks do not fit the hostfile's {total} slots "
                            f"({', '.join(f'{h.name}:{h.slots}' for h in hosts)}); add slots or nodes")
    out: list[str] = []
    for h in hosts:
        out += [h.name] * min(h.slots, n - len(out))
    return tuple(out)


def used_hosts(hosts: tuple[Host, ...], n: int) -> tuple[Host, ...]:
    """The nodes that get at least one rank: only they need an agent."""
    names = set(rank_nodes(hosts, n))
    return tuple(h for h in hosts if h.name in names)
