from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChunkTiming(_message.Message):
    __slots__ = ("rank", "kind", "microbatch", "chunk", "start_s", "end_s")
    RANK_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    START_S_FIELD_NUMBER: _ClassVar[int]
    END_S_FIELD_NUMBER: _ClassVar[int]
    rank: int
    kind: str
    microbatch: int
    chunk: int
    start_s: float
    end_s: float
    def __init__(self, rank: _Optional[int] = ..., kind: _Optional[str] = ..., microbatch: _Optional[int] = ..., chunk: _Optional[int] = ..., start_s: _Optional[float] = ..., end_s: _Optional[float] = ...) -> None: ...

class MicroBatch(_message.Message):
    __slots__ = ("seqlens",)
    SEQLENS_FIELD_NUMBER: _ClassVar[int]
    seqlens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seqlens: _Optional[_Iterable[int]] = ...) -> None: ...

class PackedChunks(_message.Message):
    __slots__ = ("kinds", "microbatch", "chunk", "start_s", "end_s")
    KINDS_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    START_S_FIELD_NUMBER: _ClassVar[int]
    END_S_FIELD_NUMBER: _ClassVar[int]
    kinds: str
    microbatch: _containers.RepeatedScalarFieldContainer[int]
    chunk: _containers.RepeatedScalarFieldContainer[int]
    start_s: _containers.RepeatedScalarFieldContainer[float]
    end_s: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, kinds: _Optional[str] = ..., microbatch: _Optional[_Iterable[int]] = ..., chunk: _Optional[_Iterable[int]] = ..., start_s: _Optional[_Iterable[float]] = ..., end_s: _Optional[_Iterable[float]] = ...) -> None: ...

class RankReport(_message.Message):
    __slots__ = ("rank", "epoch", "iteration", "start_s", "step_s", "microbatches", "chunks", "seqlens_count", "seqlens_flat", "packed_chunks")
    RANK_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    START_S_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    SEQLENS_COUNT_FIELD_NUMBER: _ClassVar[int]
    SEQLENS_FLAT_FIELD_NUMBER: _ClassVar[int]
    PACKED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    epoch: int
    iteration: int
    start_s: float
    step_s: float
    microbatches: _containers.RepeatedCompositeFieldContainer[MicroBatch]
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkTiming]
    seqlens_count: _containers.RepeatedScalarFieldContainer[int]
    seqlens_flat: _containers.RepeatedScalarFieldContainer[int]
    packed_chunks: PackedChunks
    def __init__(self, rank: _Optional[int] = ..., epoch: _Optional[int] = ..., iteration: _Optional[int] = ..., start_s: _Optional[float] = ..., step_s: _Optional[float] = ..., microbatches: _Optional[_Iterable[_Union[MicroBatch, _Mapping]]] = ..., chunks: _Optional[_Iterable[_Union[ChunkTiming, _Mapping]]] = ..., seqlens_count: _Optional[_Iterable[int]] = ..., seqlens_flat: _Optional[_Iterable[int]] = ..., packed_chunks: _Optional[_Union[PackedChunks, _Mapping]] = ...) -> None: ...

class RankHeartbeat(_message.Message):
    __slots__ = ("rank", "time_s", "iteration", "op_kind", "op_name", "op_done", "op_seq")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    OP_KIND_FIELD_NUMBER: _ClassVar[int]
    OP_NAME_FIELD_NUMBER: _ClassVar[int]
    OP_DONE_FIELD_NUMBER: _ClassVar[int]
    OP_SEQ_FIELD_NUMBER: _ClassVar[int]
    rank: int
    time_s: float
    iteration: int
    op_kind: str
    op_name: str
    op_done: bool
    op_seq: int
    def __init__(self, rank: _Optional[int] = ..., time_s: _Optional[float] = ..., iteration: _Optional[int] = ..., op_kind: _Optional[str] = ..., op_name: _Optional[str] = ..., op_done: _Optional[bool] = ..., op_seq: _Optional[int] = ...) -> None: ...

class RankProbe(_message.Message):
    __slots__ = ("rank", "time_s", "probe_s")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    PROBE_S_FIELD_NUMBER: _ClassVar[int]
    rank: int
    time_s: float
    probe_s: float
    def __init__(self, rank: _Optional[int] = ..., time_s: _Optional[float] = ..., probe_s: _Optional[float] = ...) -> None: ...

class GpuSample(_message.Message):
    __slots__ = ("gpu", "uuid", "model_name", "time_s", "sm_clock_hz", "sm_clock_max_hz", "clock_event_reasons", "temperature_celsius", "power_watts", "ecc_corrected_total", "ecc_uncorrected_total", "xid_events")
    GPU_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    SM_CLOCK_HZ_FIELD_NUMBER: _ClassVar[int]
    SM_CLOCK_MAX_HZ_FIELD_NUMBER: _ClassVar[int]
    CLOCK_EVENT_REASONS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_CELSIUS_FIELD_NUMBER: _ClassVar[int]
    POWER_WATTS_FIELD_NUMBER: _ClassVar[int]
    ECC_CORRECTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ECC_UNCORRECTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    XID_EVENTS_FIELD_NUMBER: _ClassVar[int]
    gpu: int
    uuid: str
    model_name: str
    time_s: float
    sm_clock_hz: float
    sm_clock_max_hz: float
    clock_event_reasons: int
    temperature_celsius: float
    power_watts: float
    ecc_corrected_total: int
    ecc_uncorrected_total: int
    xid_events: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, gpu: _Optional[int] = ..., uuid: _Optional[str] = ..., model_name: _Optional[str] = ..., time_s: _Optional[float] = ..., sm_clock_hz: _Optional[float] = ..., sm_clock_max_hz: _Optional[float] = ..., clock_event_reasons: _Optional[int] = ..., temperature_celsius: _Optional[float] = ..., power_watts: _Optional[float] = ..., ecc_corrected_total: _Optional[int] = ..., ecc_uncorrected_total: _Optional[int] = ..., xid_events: _Optional[_Iterable[int]] = ...) -> None: ...

class ProcessSample(_message.Message):
    __slots__ = ("rank", "pid", "time_s", "cpu_seconds_total", "rss_bytes")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    CPU_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    pid: int
    time_s: float
    cpu_seconds_total: float
    rss_bytes: int
    def __init__(self, rank: _Optional[int] = ..., pid: _Optional[int] = ..., time_s: _Optional[float] = ..., cpu_seconds_total: _Optional[float] = ..., rss_bytes: _Optional[int] = ...) -> None: ...

class RankExit(_message.Message):
    __slots__ = ("rank", "pid", "time_s", "code", "clean")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    CLEAN_FIELD_NUMBER: _ClassVar[int]
    rank: int
    pid: int
    time_s: float
    code: int
    clean: bool
    def __init__(self, rank: _Optional[int] = ..., pid: _Optional[int] = ..., time_s: _Optional[float] = ..., code: _Optional[int] = ..., clean: _Optional[bool] = ...) -> None: ...

class Throttle(_message.Message):
    __slots__ = ("factor",)
    FACTOR_FIELD_NUMBER: _ClassVar[int]
    factor: float
    def __init__(self, factor: _Optional[float] = ...) -> None: ...

class Reconfigure(_message.Message):
    __slots__ = ("plan_json",)
    PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    plan_json: str
    def __init__(self, plan_json: _Optional[str] = ...) -> None: ...

class Drain(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Notice(_message.Message):
    __slots__ = ("kind", "text", "rank", "cause", "code", "time_s", "iteration")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    kind: str
    text: str
    rank: int
    cause: str
    code: int
    time_s: float
    iteration: int
    def __init__(self, kind: _Optional[str] = ..., text: _Optional[str] = ..., rank: _Optional[int] = ..., cause: _Optional[str] = ..., code: _Optional[int] = ..., time_s: _Optional[float] = ..., iteration: _Optional[int] = ...) -> None: ...

class Command(_message.Message):
    __slots__ = ("seq", "epoch", "apply_at", "reason", "ranks", "issued_s", "reconfigure", "throttle", "drain", "notice")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    APPLY_AT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ISSUED_S_FIELD_NUMBER: _ClassVar[int]
    RECONFIGURE_FIELD_NUMBER: _ClassVar[int]
    THROTTLE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    NOTICE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    epoch: int
    apply_at: int
    reason: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    issued_s: float
    reconfigure: Reconfigure
    throttle: Throttle
    drain: Drain
    notice: Notice
    def __init__(self, seq: _Optional[int] = ..., epoch: _Optional[int] = ..., apply_at: _Optional[int] = ..., reason: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ..., issued_s: _Optional[float] = ..., reconfigure: _Optional[_Union[Reconfigure, _Mapping]] = ..., throttle: _Optional[_Union[Throttle, _Mapping]] = ..., drain: _Optional[_Union[Drain, _Mapping]] = ..., notice: _Optional[_Union[Notice, _Mapping]] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("rank", "seq", "epoch", "iteration", "ok", "error", "time_s")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    rank: int
    seq: int
    epoch: int
    iteration: int
    ok: bool
    error: str
    time_s: float
    def __init__(self, rank: _Optional[int] = ..., seq: _Optional[int] = ..., epoch: _Optional[int] = ..., iteration: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., time_s: _Optional[float] = ...) -> None: ...

class HookHello(_message.Message):
    __slots__ = ("rank", "local_rank", "pid", "job", "reshapes", "model_json")
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    RESHAPES_FIELD_NUMBER: _ClassVar[int]
    MODEL_JSON_FIELD_NUMBER: _ClassVar[int]
    rank: int
    local_rank: int
    pid: int
    job: str
    reshapes: bool
    model_json: str
    def __init__(self, rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., pid: _Optional[int] = ..., job: _Optional[str] = ..., reshapes: _Optional[bool] = ..., model_json: _Optional[str] = ...) -> None: ...

class HookWelcome(_message.Message):
    __slots__ = ("node", "job", "coordinator_connected")
    NODE_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    node: str
    job: str
    coordinator_connected: bool
    def __init__(self, node: _Optional[str] = ..., job: _Optional[str] = ..., coordinator_connected: _Optional[bool] = ...) -> None: ...

class HookReportBatch(_message.Message):
    __slots__ = ("reports", "heartbeats", "probes")
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEATS_FIELD_NUMBER: _ClassVar[int]
    PROBES_FIELD_NUMBER: _ClassVar[int]
    reports: _containers.RepeatedCompositeFieldContainer[RankReport]
    heartbeats: _containers.RepeatedCompositeFieldContainer[RankHeartbeat]
    probes: _containers.RepeatedCompositeFieldContainer[RankProbe]
    def __init__(self, reports: _Optional[_Iterable[_Union[RankReport, _Mapping]]] = ..., heartbeats: _Optional[_Iterable[_Union[RankHeartbeat, _Mapping]]] = ..., probes: _Optional[_Iterable[_Union[RankProbe, _Mapping]]] = ...) -> None: ...

class HookReportReply(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    def __init__(self, accepted: _Optional[int] = ...) -> None: ...

class CommandsRequest(_message.Message):
    __slots__ = ("rank", "after_seq")
    RANK_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    rank: int
    after_seq: int
    def __init__(self, rank: _Optional[int] = ..., after_seq: _Optional[int] = ...) -> None: ...

class Goodbye(_message.Message):
    __slots__ = ("rank", "pid")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    rank: int
    pid: int
    def __init__(self, rank: _Optional[int] = ..., pid: _Optional[int] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LocalRank(_message.Message):
    __slots__ = ("rank", "local_rank", "pid", "reshapes", "model_json")
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RESHAPES_FIELD_NUMBER: _ClassVar[int]
    MODEL_JSON_FIELD_NUMBER: _ClassVar[int]
    rank: int
    local_rank: int
    pid: int
    reshapes: bool
    model_json: str
    def __init__(self, rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., pid: _Optional[int] = ..., reshapes: _Optional[bool] = ..., model_json: _Optional[str] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("node", "job", "ranks", "address", "sampler_degraded", "sampler_status")
    NODE_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_DEGRADED_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_STATUS_FIELD_NUMBER: _ClassVar[int]
    node: str
    job: str
    ranks: _containers.RepeatedCompositeFieldContainer[LocalRank]
    address: str
    sampler_degraded: bool
    sampler_status: str
    def __init__(self, node: _Optional[str] = ..., job: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[LocalRank, _Mapping]]] = ..., address: _Optional[str] = ..., sampler_degraded: _Optional[bool] = ..., sampler_status: _Optional[str] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("agent_id", "epoch", "last_seq", "world_size", "heartbeat_interval_s", "plan_json")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    epoch: int
    last_seq: int
    world_size: int
    heartbeat_interval_s: float
    plan_json: str
    def __init__(self, agent_id: _Optional[str] = ..., epoch: _Optional[int] = ..., last_seq: _Optional[int] = ..., world_size: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ..., plan_json: _Optional[str] = ...) -> None: ...

class AgentHeartbeat(_message.Message):
    __slots__ = ("time_s", "ranks", "sampler_degraded", "sampler_status")
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_DEGRADED_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_STATUS_FIELD_NUMBER: _ClassVar[int]
    time_s: float
    ranks: _containers.RepeatedCompositeFieldContainer[RankHeartbeat]
    sampler_degraded: bool
    sampler_status: str
    def __init__(self, time_s: _Optional[float] = ..., ranks: _Optional[_Iterable[_Union[RankHeartbeat, _Mapping]]] = ..., sampler_degraded: _Optional[bool] = ..., sampler_status: _Optional[str] = ...) -> None: ...

class InjectResult(_message.Message):
    __slots__ = ("kind", "rank", "ok", "detail")
    KIND_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    kind: str
    rank: int
    ok: bool
    detail: str
    def __init__(self, kind: _Optional[str] = ..., rank: _Optional[int] = ..., ok: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("agent_id", "node", "reports", "acks", "exits", "gpus", "processes", "joined", "injections", "heartbeat", "probes")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    ACKS_FIELD_NUMBER: _ClassVar[int]
    EXITS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    INJECTIONS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    PROBES_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    node: str
    reports: _containers.RepeatedCompositeFieldContainer[RankReport]
    acks: _containers.RepeatedCompositeFieldContainer[Ack]
    exits: _containers.RepeatedCompositeFieldContainer[RankExit]
    gpus: _containers.RepeatedCompositeFieldContainer[GpuSample]
    processes: _containers.RepeatedCompositeFieldContainer[ProcessSample]
    joined: _containers.RepeatedCompositeFieldContainer[LocalRank]
    injections: _containers.RepeatedCompositeFieldContainer[InjectResult]
    heartbeat: AgentHeartbeat
    probes: _containers.RepeatedCompositeFieldContainer[RankProbe]
    def __init__(self, agent_id: _Optional[str] = ..., node: _Optional[str] = ..., reports: _Optional[_Iterable[_Union[RankReport, _Mapping]]] = ..., acks: _Optional[_Iterable[_Union[Ack, _Mapping]]] = ..., exits: _Optional[_Iterable[_Union[RankExit, _Mapping]]] = ..., gpus: _Optional[_Iterable[_Union[GpuSample, _Mapping]]] = ..., processes: _Optional[_Iterable[_Union[ProcessSample, _Mapping]]] = ..., joined: _Optional[_Iterable[_Union[LocalRank, _Mapping]]] = ..., injections: _Optional[_Iterable[_Union[InjectResult, _Mapping]]] = ..., heartbeat: _Optional[_Union[AgentHeartbeat, _Mapping]] = ..., probes: _Optional[_Iterable[_Union[RankProbe, _Mapping]]] = ...) -> None: ...

class AgentOrder(_message.Message):
    __slots__ = ("kill",)
    KILL_FIELD_NUMBER: _ClassVar[int]
    kill: KillRank
    def __init__(self, kill: _Optional[_Union[KillRank, _Mapping]] = ...) -> None: ...

class KillRank(_message.Message):
    __slots__ = ("rank", "reason", "fence", "pid")
    RANK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    rank: int
    reason: str
    fence: bool
    pid: int
    def __init__(self, rank: _Optional[int] = ..., reason: _Optional[str] = ..., fence: _Optional[bool] = ..., pid: _Optional[int] = ...) -> None: ...

class CoordinatorMessage(_message.Message):
    __slots__ = ("commands", "orders")
    COMMANDS_FIELD_NUMBER: _ClassVar[int]
    ORDERS_FIELD_NUMBER: _ClassVar[int]
    commands: _containers.RepeatedCompositeFieldContainer[Command]
    orders: _containers.RepeatedCompositeFieldContainer[AgentOrder]
    def __init__(self, commands: _Optional[_Iterable[_Union[Command, _Mapping]]] = ..., orders: _Optional[_Iterable[_Union[AgentOrder, _Mapping]]] = ...) -> None: ...

class RankStatus(_message.Message):
    __slots__ = ("rank", "node", "state", "iteration", "step_s", "speed", "last_seen_age_s", "role", "probe_ratio", "kept")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    SPEED_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_AGE_S_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PROBE_RATIO_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node: str
    state: str
    iteration: int
    step_s: float
    speed: float
    last_seen_age_s: float
    role: str
    probe_ratio: float
    kept: str
    def __init__(self, rank: _Optional[int] = ..., node: _Optional[str] = ..., state: _Optional[str] = ..., iteration: _Optional[int] = ..., step_s: _Optional[float] = ..., speed: _Optional[float] = ..., last_seen_age_s: _Optional[float] = ..., role: _Optional[str] = ..., probe_ratio: _Optional[float] = ..., kept: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("job", "state", "state_reason", "epoch", "iteration", "world_size", "ranks", "agents_connected", "engine", "policy", "uptime_s", "planner_profile", "observe_only", "model")
    class PolicyEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_REASON_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    AGENTS_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    PLANNER_PROFILE_FIELD_NUMBER: _ClassVar[int]
    OBSERVE_ONLY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    job: str
    state: str
    state_reason: str
    epoch: int
    iteration: int
    world_size: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankStatus]
    agents_connected: int
    engine: str
    policy: _containers.ScalarMap[str, str]
    uptime_s: float
    planner_profile: str
    observe_only: str
    model: str
    def __init__(self, job: _Optional[str] = ..., state: _Optional[str] = ..., state_reason: _Optional[str] = ..., epoch: _Optional[int] = ..., iteration: _Optional[int] = ..., world_size: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankStatus, _Mapping]]] = ..., agents_connected: _Optional[int] = ..., engine: _Optional[str] = ..., policy: _Optional[_Mapping[str, str]] = ..., uptime_s: _Optional[float] = ..., planner_profile: _Optional[str] = ..., observe_only: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class EventsRequest(_message.Message):
    __slots__ = ("after_seq", "limit")
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    after_seq: int
    limit: int
    def __init__(self, after_seq: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class EventsReply(_message.Message):
    __slots__ = ("events_json",)
    EVENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    events_json: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, events_json: _Optional[_Iterable[str]] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PlanReply(_message.Message):
    __slots__ = ("epoch", "plan_json")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    plan_json: str
    def __init__(self, epoch: _Optional[int] = ..., plan_json: _Optional[str] = ...) -> None: ...

class InjectRequest(_message.Message):
    __slots__ = ("kind", "rank", "factor")
    KIND_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    FACTOR_FIELD_NUMBER: _ClassVar[int]
    kind: str
    rank: int
    factor: float
    def __init__(self, kind: _Optional[str] = ..., rank: _Optional[int] = ..., factor: _Optional[float] = ...) -> None: ...

class RankRequest(_message.Message):
    __slots__ = ("rank", "reason")
    RANK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    rank: int
    reason: str
    def __init__(self, rank: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class PolicyRequest(_message.Message):
    __slots__ = ("set",)
    class SetEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SET_FIELD_NUMBER: _ClassVar[int]
    set: _containers.ScalarMap[str, str]
    def __init__(self, set: _Optional[_Mapping[str, str]] = ...) -> None: ...

class PolicyReply(_message.Message):
    __slots__ = ("policy",)
    class PolicyEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: _containers.ScalarMap[str, str]
    def __init__(self, policy: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ReplanRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class AdminReply(_message.Message):
    __slots__ = ("ok", "message", "epoch", "seq")
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    message: str
    epoch: int
    seq: int
    def __init__(self, ok: _Optional[bool] = ..., message: _Optional[str] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ...) -> None: ...
