"""A scripted trainer for control-plane tests and the bench: no torch, real hooks.

Runs one or more ranks in one process, in lockstep (a step lasts as long as its slowest
rank, as in a synchronous job). Every rank reports per-micro-batch F and B chunk timings
and packed sequence lengths through a real ``AgentClient``. Commands are applied at
their ``apply_at`` iteration and acknowledged; throttles multiply the rank's compute;
drain ends the loop. It says it reshapes (it applies a ReconfigCommand); ``--observe-only``
makes it a loop that keeps its own model (a peer's failure then ends it with code 75). Faults: ``--slow RANK:ITER:FACTOR`` and ``--hang-at ITER`` (the
process stops itself with SIGSTOP: alive but silent). Every applied command is logged
as one JSON line to ``--log``.

    python tests/fake_trainer.py --ranks 0,1 --world 4 --tp 1 --pp 2 --dp 2 --agent 127.0.0.1:PORT
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.model.trace import ChunkTiming
from resihp.coordinator.protocol import messages as m
from resihp.trainer_hooks.reporting.agent_client import AgentClient, agent_address_from_env
from resihp.trainer_hooks.reporting.notices import NoticeHandler, exit_on_peer_failure_default


@dataclass
class RankState:
    rank: int
    client: AgentClient
    throttle: float = 1.0
    pending: list[m.Command] = field(default_factory=list)


def seqlens_for(iteration: int, replica: int, microbatches: int, tokens: int) -> list[list[int]]:
    """Deterministic packed batches: two documents per micro-batch, varying split."""
    out = []
    for mb in range(microbatches):
        a = 64 + (iteration * 7 + replica * 13 + mb * 29) % (tokens - 128)
        out.append([a, tokens - a])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", default="", help="comma-separated ranks this process runs (default: the MPI rank)")
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, default=0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=0, help="global micro-batches (default 2 per replica)")
    p.add_argument("--agent", default="", help="hook address (default: from the environment resihp launch sets)")
    p.add_argument("--job", default=os.environ.get("RESIHP_JOB", "job"))
    p.add_argument("--iters", type=int, default=0, help="0 = until drained or killed")
    p.add_argument("--chunk-s", type=float, default=0.004, help="healthy compute seconds per F chunk (B = 2x)")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--slow", action="append", default=[], metavar="RANK:ITER:FACTOR")
    p.add_argument("--hang-at", type=int, default=-1)
    p.add_argument("--observe-only", action="store_true",
                   help="say reshapes=false in the hello (a loop that keeps its own model)")
    p.add_argument("--log", default="")
    p.add_argument("--hang-after-leave", action="store_true",
                   help="after a clean goodbye, never exit (as Open MPI's finalisation can hang)")
    args = p.parse_args(argv)
    ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else [int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))]
    agent = args.agent or agent_address_from_env(ranks[0])
    dp = args.dp or args.world // (args.tp * args.pp)
    plan = Plan.uniform(args.tp, args.pp, dp, args.layers, args.microbatches or 2 * dp)
    slow = {}
    for item in args.slow:
        r, it, f = item.split(":")
        slow[int(r)] = (int(it), float(f))
    log_lock = threading.Lock()
    log_fh = open(args.log, "a", encoding="utf-8") if args.log else None

    def log(obj: dict[str, object]) -> None:
        if log_fh is not None:
            with log_lock:
                log_fh.write(json.dumps(obj) + "\n")
                log_fh.flush()

    model_json = json.dumps({"name": "fake", "num_layers": args.layers})

    def notice_logger(rank: int) -> Callable[[m.NoticeCommand], None]:
        # the real handler (prints; on a peer failure of an observe-only job: exit 75), after a log line
        handler = NoticeHandler(rank, exit_on_peer_failure_default(not args.observe_only))

        def on_notice(n: m.NoticeCommand) -> None:
            log({"event": "notice", "rank": rank, "kind": n.kind, "about": n.rank, "code": n.code, "cause": n.cause,
                 "text": n.text, "seq": n.seq, "time": time.time()})
            handler(n)
        return on_notice

    states = [RankState(r, AgentClient(r, agent, r, args.job, reshapes=not args.observe_only, model_json=model_json,
                                       on_notice=notice_logger(r)).start()) for r in ranks]
    log({"event": "started", "pid": os.getpid(), "ranks": ranks})
    it = 0
    stop = False
    while not stop and (args.iters == 0 or it < args.iters):
        if it == args.hang_at:
            log({"event": "hang", "iteration": it, "time": time.time()})
            os.kill(os.getpid(), signal.SIGSTOP)
        # apply commands due at this iteration, before the step (a step boundary)
        for st in states:
            st.pending += st.client.poll_commands()
            due = [c for c in st.pending if c.apply_at <= it]
            st.pending = [c for c in st.pending if c.apply_at > it]
            for cmd in due:
                if cmd.apply_at < it and isinstance(cmd, m.ReconfigCommand):
                    st.client.ack(cmd, it, ok=False, error=f"arrived at iteration {it}, after apply_at {cmd.apply_at}")
                    log({"event": "missed", "rank": st.rank, "seq": cmd.seq, "iteration": it})
                    continue
                if isinstance(cmd, m.ReconfigCommand):
                    plan = cmd.plan
                elif isinstance(cmd, m.ThrottleCommand):
                    st.throttle = cmd.factor
                else:
                    stop = True
                st.client.ack(cmd, it)
                log({"event": "applied", "rank": st.rank, "seq": cmd.seq, "epoch": cmd.epoch,
                     "kind": m.command_kind(cmd), "apply_at": cmd.apply_at, "iteration": it, "time": time.time()})
        if stop:
            break
        start = time.time()
        timings: dict[int, list[ChunkTiming]] = {}
        longest = 0.0
        for st in states:
            if not plan.has_rank(st.rank):
                timings[st.rank] = []
                continue
            factor = st.throttle
            if st.rank in slow and it >= slow[st.rank][0]:
                factor *= slow[st.rank][1]
            pos = plan.position(st.rank)
            mbs = plan.replicas[pos.replica].microbatches
            t, chunks = 0.0, []
            for mb in range(mbs):
                f, b = args.chunk_s * factor, 2 * args.chunk_s * factor
                chunks.append(ChunkTiming(st.rank, "F", mb, 0, t, t + f))
                chunks.append(ChunkTiming(st.rank, "B", mb, 0, t + f, t + f + b))
                t += f + b
            timings[st.rank] = chunks
            longest = max(longest, t)
        time.sleep(longest or 2 * 3 * args.chunk_s)  # a spare idles at the healthy pace
        step = time.time() - start
        for st in states:
            if not plan.has_rank(st.rank):
                continue
            pos = plan.position(st.rank)
            rep = plan.replicas[pos.replica]
            st.client.report(it, step, start, seqlens_for(it, pos.replica, rep.microbatches, args.tokens),
                             timings[st.rank], epoch=plan.epoch)
        it += 1
    for st in states:
        st.client.close(clean=True)
    log({"event": "finished", "iteration": it})
    if args.hang_after_leave:
        threading.Event().wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
