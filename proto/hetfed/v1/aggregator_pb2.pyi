from hetfed.v1 import payloads_pb2 as _payloads_pb2
from hetfed.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACTION_UNSPECIFIED: _ClassVar[Action]
    ACTION_WAIT: _ClassVar[Action]
    ACTION_TRAIN: _ClassVar[Action]
    ACTION_EVALUATE: _ClassVar[Action]
    ACTION_FINISH: _ClassVar[Action]
    ACTION_SETUP: _ClassVar[Action]

class RunState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATE_UNSPECIFIED: _ClassVar[RunState]
    RUN_STATE_WAITING: _ClassVar[RunState]
    RUN_STATE_RUNNING: _ClassVar[RunState]
    RUN_STATE_EVALUATING: _ClassVar[RunState]
    RUN_STATE_FINISHED: _ClassVar[RunState]
    RUN_STATE_SETUP: _ClassVar[RunState]
ACTION_UNSPECIFIED: Action
ACTION_WAIT: Action
ACTION_TRAIN: Action
ACTION_EVALUATE: Action
ACTION_FINISH: Action
ACTION_SETUP: Action
RUN_STATE_UNSPECIFIED: RunState
RUN_STATE_WAITING: RunState
RUN_STATE_RUNNING: RunState
RUN_STATE_EVALUATING: RunState
RUN_STATE_FINISHED: RunState
RUN_STATE_SETUP: RunState

class Envelope(_message.Message):
    __slots__ = ("run_id", "round", "organization_id", "payload_kinds")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_KINDS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    organization_id: str
    payload_kinds: _containers.RepeatedScalarFieldContainer[_payloads_pb2.PayloadKind]
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., organization_id: _Optional[str] = ..., payload_kinds: _Optional[_Iterable[_Union[_payloads_pb2.PayloadKind, str]]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("index", "count", "total_bytes", "data", "sha256", "blake3")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    BLAKE3_FIELD_NUMBER: _ClassVar[int]
    index: int
    count: int
    total_bytes: int
    data: bytes
    sha256: bytes
    blake3: bytes
    def __init__(self, index: _Optional[int] = ..., count: _Optional[int] = ..., total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., sha256: _Optional[bytes] = ..., blake3: _Optional[bytes] = ...) -> None: ...

class DeclaredTensor(_message.Message):
    __slots__ = ("payload_kind", "name", "dtype", "shape")
    PAYLOAD_KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    payload_kind: _payloads_pb2.PayloadKind
    name: str
    dtype: _tensor_pb2.Dtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, payload_kind: _Optional[_Union[_payloads_pb2.PayloadKind, str]] = ..., name: _Optional[str] = ..., dtype: _Optional[_Union[_tensor_pb2.Dtype, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class DatasetFingerprint(_message.Message):
    __slots__ = ("id", "sha256")
    ID_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    id: str
    sha256: str
    def __init__(self, id: _Optional[str] = ..., sha256: _Optional[str] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("run_id", "organization_id", "declared_tensors", "seed_set", "num_train_examples", "num_classes", "input_shape")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    DECLARED_TENSORS_FIELD_NUMBER: _ClassVar[int]
    SEED_SET_FIELD_NUMBER: _ClassVar[int]
    NUM_TRAIN_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    NUM_CLASSES_FIELD_NUMBER: _ClassVar[int]
    INPUT_SHAPE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    organization_id: str
    declared_tensors: _containers.RepeatedCompositeFieldContainer[DeclaredTensor]
    seed_set: DatasetFingerprint
    num_train_examples: int
    num_classes: int
    input_shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, run_id: _Optional[str] = ..., organization_id: _Optional[str] = ..., declared_tensors: _Optional[_Iterable[_Union[DeclaredTensor, _Mapping]]] = ..., seed_set: _Optional[_Union[DatasetFingerprint, _Mapping]] = ..., num_train_examples: _Optional[int] = ..., num_classes: _Optional[int] = ..., input_shape: _Optional[_Iterable[int]] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("run_id", "algorithm", "algorithm_config_json", "current_round", "total_rounds", "seed", "organizations", "declare_required", "push_admission_headers", "secure_aggregation")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    CURRENT_ROUND_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ORGANIZATIONS_FIELD_NUMBER: _ClassVar[int]
    DECLARE_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    PUSH_ADMISSION_HEADERS_FIELD_NUMBER: _ClassVar[int]
    SECURE_AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    algorithm: str
    algorithm_config_json: str
    current_round: int
    total_rounds: int
    seed: int
    organizations: _containers.RepeatedScalarFieldContainer[str]
    declare_required: bool
    push_admission_headers: bool
    secure_aggregation: bool
    def __init__(self, run_id: _Optional[str] = ..., algorithm: _Optional[str] = ..., algorithm_config_json: _Optional[str] = ..., current_round: _Optional[int] = ..., total_rounds: _Optional[int] = ..., seed: _Optional[int] = ..., organizations: _Optional[_Iterable[str]] = ..., declare_required: _Optional[bool] = ..., push_admission_headers: _Optional[bool] = ..., secure_aggregation: _Optional[bool] = ...) -> None: ...

class PullInstructionsRequest(_message.Message):
    __slots__ = ("run_id", "organization_id", "completed_round", "wait_seconds")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_ROUND_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    organization_id: str
    completed_round: int
    wait_seconds: float
    def __init__(self, run_id: _Optional[str] = ..., organization_id: _Optional[str] = ..., completed_round: _Optional[int] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class PullInstructionsResponse(_message.Message):
    __slots__ = ("chunk",)
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    chunk: Chunk
    def __init__(self, chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class Instructions(_message.Message):
    __slots__ = ("envelope", "action", "round_seed", "payloads", "total_rounds")
    ENVELOPE_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    ROUND_SEED_FIELD_NUMBER: _ClassVar[int]
    PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    envelope: Envelope
    action: Action
    round_seed: int
    payloads: _containers.RepeatedCompositeFieldContainer[_payloads_pb2.Payload]
    total_rounds: int
    def __init__(self, envelope: _Optional[_Union[Envelope, _Mapping]] = ..., action: _Optional[_Union[Action, str]] = ..., round_seed: _Optional[int] = ..., payloads: _Optional[_Iterable[_Union[_payloads_pb2.Payload, _Mapping]]] = ..., total_rounds: _Optional[int] = ...) -> None: ...

class PrivacyDeclaration(_message.Message):
    __slots__ = ("mechanism", "noise_multiplier", "clip_norm", "epsilon", "delta", "accountant", "budget_spent", "ephemeral_ledger")
    MECHANISM_FIELD_NUMBER: _ClassVar[int]
    NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    ACCOUNTANT_FIELD_NUMBER: _ClassVar[int]
    BUDGET_SPENT_FIELD_NUMBER: _ClassVar[int]
    EPHEMERAL_LEDGER_FIELD_NUMBER: _ClassVar[int]
    mechanism: str
    noise_multiplier: float
    clip_norm: float
    epsilon: float
    delta: float
    accountant: str
    budget_spent: bool
    ephemeral_ledger: bool
    def __init__(self, mechanism: _Optional[str] = ..., noise_multiplier: _Optional[float] = ..., clip_norm: _Optional[float] = ..., epsilon: _Optional[float] = ..., delta: _Optional[float] = ..., accountant: _Optional[str] = ..., budget_spent: _Optional[bool] = ..., ephemeral_ledger: _Optional[bool] = ...) -> None: ...

class Update(_message.Message):
    __slots__ = ("envelope", "payloads", "privacy", "leave_reason")
    ENVELOPE_FIELD_NUMBER: _ClassVar[int]
    PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    PRIVACY_FIELD_NUMBER: _ClassVar[int]
    LEAVE_REASON_FIELD_NUMBER: _ClassVar[int]
    envelope: Envelope
    payloads: _containers.RepeatedCompositeFieldContainer[_payloads_pb2.Payload]
    privacy: PrivacyDeclaration
    leave_reason: str
    def __init__(self, envelope: _Optional[_Union[Envelope, _Mapping]] = ..., payloads: _Optional[_Iterable[_Union[_payloads_pb2.Payload, _Mapping]]] = ..., privacy: _Optional[_Union[PrivacyDeclaration, _Mapping]] = ..., leave_reason: _Optional[str] = ...) -> None: ...

class PushUpdateRequest(_message.Message):
    __slots__ = ("run_id", "round", "organization_id", "chunk", "update_blake3")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    UPDATE_BLAKE3_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    organization_id: str
    chunk: Chunk
    update_blake3: bytes
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., organization_id: _Optional[str] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., update_blake3: _Optional[bytes] = ...) -> None: ...

class PushProgressRequest(_message.Message):
    __slots__ = ("run_id", "round", "organization_id", "update_blake3", "total_bytes")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    UPDATE_BLAKE3_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    organization_id: str
    update_blake3: bytes
    total_bytes: int
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., organization_id: _Optional[str] = ..., update_blake3: _Optional[bytes] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class PushProgressResponse(_message.Message):
    __slots__ = ("chunks_held", "bytes_held")
    CHUNKS_HELD_FIELD_NUMBER: _ClassVar[int]
    BYTES_HELD_FIELD_NUMBER: _ClassVar[int]
    chunks_held: int
    bytes_held: int
    def __init__(self, chunks_held: _Optional[int] = ..., bytes_held: _Optional[int] = ...) -> None: ...

class PushUpdateResponse(_message.Message):
    __slots__ = ("accepted", "duplicate", "round")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    duplicate: bool
    round: int
    def __init__(self, accepted: _Optional[bool] = ..., duplicate: _Optional[bool] = ..., round: _Optional[int] = ...) -> None: ...

class SecureStageRequest(_message.Message):
    __slots__ = ("run_id", "round", "organization_id", "payload", "wait_seconds")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    organization_id: str
    payload: _payloads_pb2.Payload
    wait_seconds: float
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., organization_id: _Optional[str] = ..., payload: _Optional[_Union[_payloads_pb2.Payload, _Mapping]] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class SecureStageResponse(_message.Message):
    __slots__ = ("payload", "stage", "abandoned")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    ABANDONED_FIELD_NUMBER: _ClassVar[int]
    payload: _payloads_pb2.Payload
    stage: str
    abandoned: str
    def __init__(self, payload: _Optional[_Union[_payloads_pb2.Payload, _Mapping]] = ..., stage: _Optional[str] = ..., abandoned: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class TrafficCount(_message.Message):
    __slots__ = ("direction", "payload_kind", "bytes", "messages", "elements")
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_KIND_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    direction: str
    payload_kind: str
    bytes: int
    messages: int
    elements: int
    def __init__(self, direction: _Optional[str] = ..., payload_kind: _Optional[str] = ..., bytes: _Optional[int] = ..., messages: _Optional[int] = ..., elements: _Optional[int] = ...) -> None: ...

class ClientReport(_message.Message):
    __slots__ = ("organization_id", "metrics")
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    organization_id: str
    metrics: _payloads_pb2.EvalMetrics
    def __init__(self, organization_id: _Optional[str] = ..., metrics: _Optional[_Union[_payloads_pb2.EvalMetrics, _Mapping]] = ...) -> None: ...

class RoundSummary(_message.Message):
    __slots__ = ("round", "clients", "duration_seconds", "traffic", "reports", "secure_abandoned")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    SECURE_ABANDONED_FIELD_NUMBER: _ClassVar[int]
    round: int
    clients: int
    duration_seconds: float
    traffic: _containers.RepeatedCompositeFieldContainer[TrafficCount]
    reports: _containers.RepeatedCompositeFieldContainer[ClientReport]
    secure_abandoned: str
    def __init__(self, round: _Optional[int] = ..., clients: _Optional[int] = ..., duration_seconds: _Optional[float] = ..., traffic: _Optional[_Iterable[_Union[TrafficCount, _Mapping]]] = ..., reports: _Optional[_Iterable[_Union[ClientReport, _Mapping]]] = ..., secure_abandoned: _Optional[str] = ...) -> None: ...

class RunStatus(_message.Message):
    __slots__ = ("run_id", "algorithm", "state", "round", "total_rounds", "organizations", "pushed_this_round", "history", "organization_status", "refused", "refused_reason")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ORGANIZATIONS_FIELD_NUMBER: _ClassVar[int]
    PUSHED_THIS_ROUND_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    ORGANIZATION_STATUS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_REASON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    algorithm: str
    state: RunState
    round: int
    total_rounds: int
    organizations: _containers.RepeatedScalarFieldContainer[str]
    pushed_this_round: _containers.RepeatedScalarFieldContainer[str]
    history: _containers.RepeatedCompositeFieldContainer[RoundSummary]
    organization_status: _containers.RepeatedCompositeFieldContainer[OrganizationStatus]
    refused: _containers.RepeatedCompositeFieldContainer[RefusedOrganization]
    refused_reason: str
    def __init__(self, run_id: _Optional[str] = ..., algorithm: _Optional[str] = ..., state: _Optional[_Union[RunState, str]] = ..., round: _Optional[int] = ..., total_rounds: _Optional[int] = ..., organizations: _Optional[_Iterable[str]] = ..., pushed_this_round: _Optional[_Iterable[str]] = ..., history: _Optional[_Iterable[_Union[RoundSummary, _Mapping]]] = ..., organization_status: _Optional[_Iterable[_Union[OrganizationStatus, _Mapping]]] = ..., refused: _Optional[_Iterable[_Union[RefusedOrganization, _Mapping]]] = ..., refused_reason: _Optional[str] = ...) -> None: ...

class RefusedOrganization(_message.Message):
    __slots__ = ("organization_id", "reason", "message")
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    organization_id: str
    reason: str
    message: str
    def __init__(self, organization_id: _Optional[str] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class OrganizationStatus(_message.Message):
    __slots__ = ("organization_id", "joined", "last_round_pushed", "bytes_up", "bytes_down", "privacy_declared", "privacy_epsilon")
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    LAST_ROUND_PUSHED_FIELD_NUMBER: _ClassVar[int]
    BYTES_UP_FIELD_NUMBER: _ClassVar[int]
    BYTES_DOWN_FIELD_NUMBER: _ClassVar[int]
    PRIVACY_DECLARED_FIELD_NUMBER: _ClassVar[int]
    PRIVACY_EPSILON_FIELD_NUMBER: _ClassVar[int]
    organization_id: str
    joined: bool
    last_round_pushed: int
    bytes_up: int
    bytes_down: int
    privacy_declared: bool
    privacy_epsilon: float
    def __init__(self, organization_id: _Optional[str] = ..., joined: _Optional[bool] = ..., last_round_pushed: _Optional[int] = ..., bytes_up: _Optional[int] = ..., bytes_down: _Optional[int] = ..., privacy_declared: _Optional[bool] = ..., privacy_epsilon: _Optional[float] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("runs",)
    RUNS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[RunStatus]
    def __init__(self, runs: _Optional[_Iterable[_Union[RunStatus, _Mapping]]] = ...) -> None: ...
