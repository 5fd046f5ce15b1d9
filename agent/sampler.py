"""Node health samplers: GPU (NVML), process (psutil) and a scripted fake.

Every NVML call runs on one worker thread under a deadline: a missing library, a call
that raises or one that hangs turns the sampler *degraded* (reported upstream with the
reason) and never crashes or blocks the agent. A hung call leaves its worker thread
stuck, so after a hang the sampler stops calling NVML for good. The agent never imports
torch.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from resihp.coordinator.protocol.messages import GpuSample, ProcessSample

log = logging.getLogger(__name__)
T = TypeVar("T")


class Sampler(Protocol):
    def sample(self, now: float) -> list[GpuSample]: ...
    def status(self) -> tuple[bool, str]: ...  # (degraded, human text)
    def close(self) -> None: ...


class NvmlSampler:
    """GPU samples through pynvml (package nvidia-ml-py). ``nvml`` can be injected for tests."""

    def __init__(self, deadline_s: float = 2.0, nvml: Any = None) -> None:
        self.deadline_s = deadline_s
        self._nvml = nvml
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvml")
        self._degraded = False
        self._status = "initialising"
        self._handles: list[Any] = []
        self._event_set: Any = None
        self._hung = False
        self._lock = threading.Lock()
        self._init()

    def _call(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        if self._hung:
            raise RuntimeError("NVML hung earlier; not called again")
        fut = self._pool.submit(fn, *args)
        try:
            return fut.result(timeout=self.deadline_s)
        except FutureTimeout:
            self._hung = True
            self._pool.shutdown(wait=False)  # the stuck worker cannot be cancelled; abandon it
            raise RuntimeError(f"NVML call {what} hung for more than {self.deadline_s} s") from None

    def _degrade(self, reason: str) -> None:
        if not self._degraded or self._status != reason:
            log.warning("GPU sampler degraded: %s", reason)
        self._degraded, self._status = True, reason

    def _init(self) -> None:
        try:
            if self._nvml is None:
                import pynvml

                self._nvml = pynvml
            nv = self._nvml
            self._call("nvmlInit", nv.nvmlInit)
            count = self._call("nvmlDeviceGetCount", nv.nvmlDeviceGetCount)
            self._handles = [self._call("nvmlDeviceGetHandleByIndex", nv.nvmlDeviceGetHandleByIndex, i)
                             for i in range(count)]
            self._status = f"NVML ok: {count} GPU(s)"
        except ImportError as exc:
            self._degrade(f"pynvml not installed ({exc}); install nvidia-ml-py")
            return
        except Exception as exc:  # NVMLError_LibraryNotFound on machines without a driver, or a hang
            self._degrade(f"NVML unavailable: {type(exc).__name__}: {exc}")
            return
        try:  # XID events are optional: many drivers/containers do not allow them
            es = self._call("nvmlEventSetCreate", self._nvml.nvmlEventSetCreate)
            for h in self._handles:
                self._call("nvmlDeviceRegisterEvents", self._nvml.nvmlDeviceRegisterEvents, h,
                           self._nvml.nvmlEventTypeXidCriticalError, es)
            self._event_set = es
        except Exception as exc:
            log.info("XID events unavailable: %s", exc)

    def status(self) -> tuple[bool, str]:
        return self._degraded, self._status

    def _opt(self, what: str, fn: Callable[..., Any], *args: Any, default: Any = 0) -> Any:
        """A metric some GPUs lack (NotSupported) is 0; a hang still degrades."""
        try:
            return self._call(what, fn, *args)
        except RuntimeError:
            raise
        except Exception:
            return default

    def sample(self, now: float) -> list[GpuSample]:
        with self._lock:
            if self._degraded or not self._handles:
                return []
            nv = self._nvml
            out = []
            try:
                xids = self._xids()
                for i, h in enumerate(self._handles):
                    reasons_fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                        nv.nvmlDeviceGetCurrentClocksThrottleReasons
                    name = self._opt("name", nv.nvmlDeviceGetName, h, default="")
                    uuid = self._opt("uuid", nv.nvmlDeviceGetUUID, h, default="")
                    out.append(GpuSample(
                        gpu=i, time_s=now,
                        uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                        model_name=name.decode() if isinstance(name, bytes) else str(name),
                        sm_clock_hz=1e6 * self._opt("sm clock", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM),
                        sm_clock_max_hz=1e6 * self._opt("max clock", nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_SM),
                        clock_event_reasons=int(self._opt("clock reasons", reasons_fn, h)),
                        temperature_celsius=float(self._opt("temperature", nv.nvmlDeviceGetTemperature, h,
                                                            nv.NVML_TEMPERATURE_GPU)),
                        power_watts=self._opt("power", nv.nvmlDeviceGetPowerUsage, h) / 1000.0,
                        ecc_corrected_total=int(self._opt("ecc", nv.nvmlDeviceGetTotalEccErrors, h,
                                                          nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC)),
                        ecc_uncorrected_total=int(self._opt("ecc", nv.nvmlDeviceGetTotalEccErrors, h,
                                                            nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                            nv.NVML_VOLATILE_ECC)),
                        xid_events=tuple(xids.get(i, ())),
                    ))
            except RuntimeError as exc:
                self._degrade(str(exc))
                return []
            return out

    def _xids(self) -> dict[int, list[int]]:
        if self._event_set is None:
            return {}
        out: dict[int, list[int]] = {}
        for _ in range(64):  # drain what is queued, never block
            try:
                data = self._call("nvmlEventSetWait", self._nvml.nvmlEventSetWait, self._event_set, 0)
            except RuntimeError:
                raise
            except Exception:
                break
            idx = next((i for i, h in enumerate(self._handles) if h == getattr(data, "device", None)), 0)
            out.setdefault(idx, []).append(int(getattr(data, "eventData", 0)))
        return out

    def close(self) -> None:
        if not self._degraded and not self._hung:
            try:
                self._call("nvmlShutdown", self._nvml.nvmlShutdown)
            except Exception:
                pass
        self._pool.shutdown(wait=False)


@dataclass
class ScriptedSampler:
    """A fake: plays back ``script`` (one list of samples per call, last one repeated)."""

    script: Sequence[Sequence[GpuSample]] = ()
    degraded: bool = False
    reason: str = "scripted"
    calls: int = field(default=0, init=False)

    def sample(self, now: float) -> list[GpuSample]:
        if self.degraded or not self.script:
            return []
        step = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        return [GpuSample(**{**s.__dict__, "time_s": now}) for s in step]

    def status(self) -> tuple[bool, str]:
        return self.degraded, self.reason

    def close(self) -> None:
        return None


class ProcessSampler:
    """CPU time and RSS of each local rank's process (psutil); vanished pids are skipped."""

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self._procs: dict[int, Any] = {}

    def sample(self, pids: Mapping[int, int], now: float) -> list[ProcessSample]:
        out = []
        for rank, pid in pids.items():
            proc = self._procs.get(pid)
            try:
                if proc is None:
                    proc = self._procs[pid] = self._psutil.Process(pid)
                with proc.oneshot():
                    t = proc.cpu_times()
                    rss = proc.memory_info().rss
                out.append(ProcessSample(rank, pid, now, float(t.user + t.system), int(rss)))
            except (self._psutil.NoSuchProcess, self._psutil.AccessDenied, self._psutil.ZombieProcess):
                self._procs.pop(pid, None)
        return out

    def forget(self, pids: Iterable[int]) -> None:
        for pid in pids:
            self._procs.pop(pid, None)


def make_sampler(kind: str, deadline_s: float = 2.0) -> Sampler:
    """``nvml`` (degraded where there is none), ``off`` (reported degraded as disabled) or ``fake``."""
    if kind in ("nvml", "auto"):
        return NvmlSampler(deadline_s)
    if kind == "off":
        return ScriptedSampler(degraded=True, reason="GPU sampling disabled (--gpu-sampler off)")
    if kind == "fake":
        return ScriptedSampler(script=[[GpuSample(gpu=0, time_s=0.0, uuid="GPU-fake-0", model_name="Fake GPU",
                                                  sm_clock_hz=1.41e9, sm_clock_max_hz=1.41e9,
                                                  temperature_celsius=40.0, power_watts=100.0)]])
    raise ValueError(f"GPU sampler must be nvml, off or fake, got {kind!r}")
