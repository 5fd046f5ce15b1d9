"""NCCL's abort on a declared death (trainer_hooks/runtime/abort_on_death.py): which notices
abort an epoch's communicators, once, from the thread that hears them. The communicators here
are stand-ins with an ``abort`` method (NCCL needs GPUs; bench/gpu_check.sh runs the real kill
under NCCL); the notices are real commands through a real ``DeathNotices``."""
from __future__ import annotations

import gc

from resihp.coordinator.model.plan import Plan
from resihp.coordinator.protocol import messages as m
from resihp.trainer_hooks.reconfig.ulfm import is_peer_failure
from resihp.trainer_hooks.reporting.deaths import DeathNotices
from resihp.trainer_hooks.runtime.abort_on_death import AbortOnDeath


class Communicator:
    def __init__(self, name: str, fails: bool = False) -> None:
        self.name, self.fails, self.aborts = name, fails, 0

    def abort(self) -> None:
        self.aborts += 1
        if self.fails:
            raise RuntimeError("this communicator cannot abort")

    def __repr__(self) -> str:
        return self.name


def _fail_stop(epoch: int, dead: list[int]) -> m.ReconfigCommand:
    plan = Plan.uniform(1, 1, 1, 2, 1)
    return m.ReconfigCommand(seq=epoch, epoch=epoch, apply_at=0, plan=plan,
                             reason=f"fail-stop of ranks {dead}: the current plan cannot run")


def test_a_newer_fail_stop_naming_a_member_aborts_every_communicator_once() -> None:
    deaths = DeathNotices()
    tp, dp, broken = Communicator("tp"), Communicator("dp"), Communicator("peer", fails=True)
    listener = AbortOnDeath(rank=0, members=[0, 1, 2, 3], epoch=2, groups=lambda: [tp, dp, tp, None, broken],
                            deaths=deaths)
    deaths.note(_fail_stop(2, [3]))  # not newer than this epoch: an older death, already handled
    deaths.note(_fail_stop(3, [7]))  # not a member
    assert not listener.fired and tp.aborts == dp.aborts == 0
    deaths.note(_fail_stop(3, [3]))
    assert listener.fired and (tp.aborts, dp.aborts, broken.aborts) == (1, 1, 1)  # each once; one failing stops none
    assert listener.aborted == ["tp", "dp"]
    deaths.note(_fail_stop(4, [1]))
    assert (tp.aborts, dp.aborts) == (1, 1)


def test_a_listener_lives_as_long_as_its_runtime_holds_it() -> None:
    deaths = DeathNotices()
    comm = Communicator("dp")
    AbortOnDeath(rank=0, members=[0, 1], epoch=0, groups=lambda: [comm], deaths=deaths)  # nobody holds it
    gc.collect()
    deaths.note(_fail_stop(1, [1]))
    assert comm.aborts == 0


def test_an_aborted_or_remotely_failed_nccl_collective_is_a_peer_failure() -> None:
    assert is_peer_failure(RuntimeError("NCCL communicator was aborted on rank 2."))
    assert is_peer_failure(RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there "
                                        "was a network error, NCCL version 2.21.5 ncclRemoteError"))
    assert not is_peer_failure(RuntimeError("NCCL error: invalid usage (run with NCCL_DEBUG=WARN for details)"))
