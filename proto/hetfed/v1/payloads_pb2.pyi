from hetfed.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PayloadKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAYLOAD_KIND_UNSPECIFIED: _ClassVar[PayloadKind]
    PAYLOAD_KIND_MODEL_WEIGHTS: _ClassVar[PayloadKind]
    PAYLOAD_KIND_HEAD_WEIGHTS: _ClassVar[PayloadKind]
    PAYLOAD_KIND_CLASS_COUNTS: _ClassVar[PayloadKind]
    PAYLOAD_KIND_CLASS_MEAN_EMBEDDINGS: _ClassVar[PayloadKind]
    PAYLOAD_KIND_SEED_POSTERIORS: _ClassVar[PayloadKind]
    PAYLOAD_KIND_FACTORIZED_WEIGHTS: _ClassVar[PayloadKind]
    PAYLOAD_KIND_CRITERIA_EMBEDDINGS: _ClassVar[PayloadKind]
    PAYLOAD_KIND_EVAL_METRICS: _ClassVar[PayloadKind]
    PAYLOAD_KIND_PEER_WEIGHTS: _ClassVar[PayloadKind]
    PAYLOAD_KIND_SECAGG_SETUP: _ClassVar[PayloadKind]
    PAYLOAD_KIND_SECAGG_KEY_ADVERT: _ClassVar[PayloadKind]
    PAYLOAD_KIND_SECAGG_PEER_KEYS: _ClassVar[PayloadKind]
    PAYLOAD_KIND_SECAGG_SHARED_KEYS: _ClassVar[PayloadKind]
    PAYLOAD_KIND_SECAGG_PEER_SHARES: _ClassVar[PayloadKind]
    PAYLOAD_KIND_SECAGG_MASKED_INPUT: _ClassVar[PayloadKind]
    PAYLOAD_KIND_SECAGG_UNMASK: _ClassVar[PayloadKind]

class MaskEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MASK_ENCODING_UNSPECIFIED: _ClassVar[MaskEncoding]
    MASK_ENCODING_GAPS: _ClassVar[MaskEncoding]
    MASK_ENCODING_BITMAP: _ClassVar[MaskEncoding]
    MASK_ENCODING_DENSE: _ClassVar[MaskEncoding]
PAYLOAD_KIND_UNSPECIFIED: PayloadKind
PAYLOAD_KIND_MODEL_WEIGHTS: PayloadKind
PAYLOAD_KIND_HEAD_WEIGHTS: PayloadKind
PAYLOAD_KIND_CLASS_COUNTS: PayloadKind
PAYLOAD_KIND_CLASS_MEAN_EMBEDDINGS: PayloadKind
PAYLOAD_KIND_SEED_POSTERIORS: PayloadKind
PAYLOAD_KIND_FACTORIZED_WEIGHTS: PayloadKind
PAYLOAD_KIND_CRITERIA_EMBEDDINGS: PayloadKind
PAYLOAD_KIND_EVAL_METRICS: PayloadKind
PAYLOAD_KIND_PEER_WEIGHTS: PayloadKind
PAYLOAD_KIND_SECAGG_SETUP: PayloadKind
PAYLOAD_KIND_SECAGG_KEY_ADVERT: PayloadKind
PAYLOAD_KIND_SECAGG_PEER_KEYS: PayloadKind
PAYLOAD_KIND_SECAGG_SHARED_KEYS: PayloadKind
PAYLOAD_KIND_SECAGG_PEER_SHARES: PayloadKind
PAYLOAD_KIND_SECAGG_MASKED_INPUT: PayloadKind
PAYLOAD_KIND_SECAGG_UNMASK: PayloadKind
MASK_ENCODING_UNSPECIFIED: MaskEncoding
MASK_ENCODING_GAPS: MaskEncoding
MASK_ENCODING_BITMAP: MaskEncoding
MASK_ENCODING_DENSE: MaskEncoding

class ModelWeights(_message.Message):
    __slots__ = ("tensors", "num_examples")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.NamedTensor]
    num_examples: int
    def __init__(self, tensors: _Optional[_Iterable[_Union[_tensor_pb2.NamedTensor, _Mapping]]] = ..., num_examples: _Optional[int] = ...) -> None: ...

class HeadWeights(_message.Message):
    __slots__ = ("weight", "bias", "num_examples")
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    weight: _tensor_pb2.Tensor
    bias: _tensor_pb2.Tensor
    num_examples: int
    def __init__(self, weight: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., bias: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., num_examples: _Optional[int] = ...) -> None: ...

class ClassCounts(_message.Message):
    __slots__ = ("counts",)
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    counts: _tensor_pb2.Tensor
    def __init__(self, counts: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class ClassMeanEmbeddings(_message.Message):
    __slots__ = ("labels", "means", "counts", "presence")
    LABELS_FIELD_NUMBER: _ClassVar[int]
    MEANS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_FIELD_NUMBER: _ClassVar[int]
    labels: _tensor_pb2.Tensor
    means: _tensor_pb2.Tensor
    counts: _tensor_pb2.Tensor
    presence: _tensor_pb2.Tensor
    def __init__(self, labels: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., means: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., counts: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., presence: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class SeedPosteriors(_message.Message):
    __slots__ = ("seed_set_id", "indices", "probabilities", "teaching_confidence", "source_organization")
    SEED_SET_ID_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    PROBABILITIES_FIELD_NUMBER: _ClassVar[int]
    TEACHING_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ORGANIZATION_FIELD_NUMBER: _ClassVar[int]
    seed_set_id: str
    indices: _tensor_pb2.Tensor
    probabilities: _tensor_pb2.Tensor
    teaching_confidence: float
    source_organization: str
    def __init__(self, seed_set_id: _Optional[str] = ..., indices: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., probabilities: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., teaching_confidence: _Optional[float] = ..., source_organization: _Optional[str] = ...) -> None: ...

class FactorizedLayer(_message.Message):
    __slots__ = ("name", "u", "v", "mask_indices", "mask_values", "mask_shape", "mask_encoding", "mask_bitmap")
    NAME_FIELD_NUMBER: _ClassVar[int]
    U_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    MASK_INDICES_FIELD_NUMBER: _ClassVar[int]
    MASK_VALUES_FIELD_NUMBER: _ClassVar[int]
    MASK_SHAPE_FIELD_NUMBER: _ClassVar[int]
    MASK_ENCODING_FIELD_NUMBER: _ClassVar[int]
    MASK_BITMAP_FIELD_NUMBER: _ClassVar[int]
    name: str
    u: _tensor_pb2.Tensor
    v: _tensor_pb2.Tensor
    mask_indices: _tensor_pb2.Tensor
    mask_values: _tensor_pb2.Tensor
    mask_shape: _containers.RepeatedScalarFieldContainer[int]
    mask_encoding: MaskEncoding
    mask_bitmap: _tensor_pb2.Tensor
    def __init__(self, name: _Optional[str] = ..., u: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., v: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., mask_indices: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., mask_values: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., mask_shape: _Optional[_Iterable[int]] = ..., mask_encoding: _Optional[_Union[MaskEncoding, str]] = ..., mask_bitmap: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class FactorizedWeights(_message.Message):
    __slots__ = ("layers", "num_examples")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[FactorizedLayer]
    num_examples: int
    def __init__(self, layers: _Optional[_Iterable[_Union[FactorizedLayer, _Mapping]]] = ..., num_examples: _Optional[int] = ...) -> None: ...

class CriteriaEmbeddings(_message.Message):
    __slots__ = ("criteria_set_id", "embeddings")
    CRITERIA_SET_ID_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    criteria_set_id: str
    embeddings: _tensor_pb2.Tensor
    def __init__(self, criteria_set_id: _Optional[str] = ..., embeddings: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class PeerWeights(_message.Message):
    __slots__ = ("organizations", "weights")
    ORGANIZATIONS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    organizations: _containers.RepeatedScalarFieldContainer[str]
    weights: _tensor_pb2.Tensor
    def __init__(self, organizations: _Optional[_Iterable[str]] = ..., weights: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class EvalMetrics(_message.Message):
    __slots__ = ("train_loss", "num_train_examples", "test_accuracy", "test_loss", "num_test_examples", "extra", "withheld")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    NUM_TRAIN_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    TEST_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    TEST_LOSS_FIELD_NUMBER: _ClassVar[int]
    NUM_TEST_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    WITHHELD_FIELD_NUMBER: _ClassVar[int]
    train_loss: float
    num_train_examples: int
    test_accuracy: float
    test_loss: float
    num_test_examples: int
    extra: _containers.ScalarMap[str, float]
    withheld: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, train_loss: _Optional[float] = ..., num_train_examples: _Optional[int] = ..., test_accuracy: _Optional[float] = ..., test_loss: _Optional[float] = ..., num_test_examples: _Optional[int] = ..., extra: _Optional[_Mapping[str, float]] = ..., withheld: _Optional[_Iterable[str]] = ...) -> None: ...

class SecAggField(_message.Message):
    __slots__ = ("name", "shape", "bound", "norm_bound")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    BOUND_FIELD_NUMBER: _ClassVar[int]
    NORM_BOUND_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    bound: float
    norm_bound: float
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., bound: _Optional[float] = ..., norm_bound: _Optional[float] = ...) -> None: ...

class SecAggSetup(_message.Message):
    __slots__ = ("run_id", "round", "roster", "degree", "threshold", "graph_seed", "fields", "value_bits", "ring_bits", "max_inputs", "stochastic", "unit_weights")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ROSTER_FIELD_NUMBER: _ClassVar[int]
    DEGREE_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    GRAPH_SEED_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    VALUE_BITS_FIELD_NUMBER: _ClassVar[int]
    RING_BITS_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUTS_FIELD_NUMBER: _ClassVar[int]
    STOCHASTIC_FIELD_NUMBER: _ClassVar[int]
    UNIT_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    roster: _containers.RepeatedScalarFieldContainer[str]
    degree: int
    threshold: int
    graph_seed: bytes
    fields: _containers.RepeatedCompositeFieldContainer[SecAggField]
    value_bits: int
    ring_bits: int
    max_inputs: int
    stochastic: bool
    unit_weights: bool
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., roster: _Optional[_Iterable[str]] = ..., degree: _Optional[int] = ..., threshold: _Optional[int] = ..., graph_seed: _Optional[bytes] = ..., fields: _Optional[_Iterable[_Union[SecAggField, _Mapping]]] = ..., value_bits: _Optional[int] = ..., ring_bits: _Optional[int] = ..., max_inputs: _Optional[int] = ..., stochastic: _Optional[bool] = ..., unit_weights: _Optional[bool] = ...) -> None: ...

class SecAggKeyAdvert(_message.Message):
    __slots__ = ("run_id", "round", "sender", "share_public", "mask_public")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    SHARE_PUBLIC_FIELD_NUMBER: _ClassVar[int]
    MASK_PUBLIC_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    sender: str
    share_public: bytes
    mask_public: bytes
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., sender: _Optional[str] = ..., share_public: _Optional[bytes] = ..., mask_public: _Optional[bytes] = ...) -> None: ...

class SecAggPeerKeys(_message.Message):
    __slots__ = ("run_id", "round", "receiver", "peers")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    receiver: str
    peers: _containers.RepeatedCompositeFieldContainer[SecAggKeyAdvert]
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., receiver: _Optional[str] = ..., peers: _Optional[_Iterable[_Union[SecAggKeyAdvert, _Mapping]]] = ...) -> None: ...

class SecAggEncryptedShare(_message.Message):
    __slots__ = ("sender", "receiver", "ciphertext")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    CIPHERTEXT_FIELD_NUMBER: _ClassVar[int]
    sender: str
    receiver: str
    ciphertext: bytes
    def __init__(self, sender: _Optional[str] = ..., receiver: _Optional[str] = ..., ciphertext: _Optional[bytes] = ...) -> None: ...

class SecAggSharedKeys(_message.Message):
    __slots__ = ("run_id", "round", "sender", "shares")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    sender: str
    shares: _containers.RepeatedCompositeFieldContainer[SecAggEncryptedShare]
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., sender: _Optional[str] = ..., shares: _Optional[_Iterable[_Union[SecAggEncryptedShare, _Mapping]]] = ...) -> None: ...

class SecAggPeerShares(_message.Message):
    __slots__ = ("run_id", "round", "receiver", "shares")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    receiver: str
    shares: _containers.RepeatedCompositeFieldContainer[SecAggEncryptedShare]
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., receiver: _Optional[str] = ..., shares: _Optional[_Iterable[_Union[SecAggEncryptedShare, _Mapping]]] = ...) -> None: ...

class SecAggMaskedInput(_message.Message):
    __slots__ = ("run_id", "round", "sender", "vector")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    VECTOR_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    sender: str
    vector: _tensor_pb2.Tensor
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., sender: _Optional[str] = ..., vector: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class SecAggUnmaskRequest(_message.Message):
    __slots__ = ("run_id", "round", "receiver", "survivors", "dropped")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    SURVIVORS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    receiver: str
    survivors: _containers.RepeatedScalarFieldContainer[str]
    dropped: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., receiver: _Optional[str] = ..., survivors: _Optional[_Iterable[str]] = ..., dropped: _Optional[_Iterable[str]] = ...) -> None: ...

class SecAggRevealedShare(_message.Message):
    __slots__ = ("owner", "share")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    owner: str
    share: bytes
    def __init__(self, owner: _Optional[str] = ..., share: _Optional[bytes] = ...) -> None: ...

class SecAggUnmaskReply(_message.Message):
    __slots__ = ("run_id", "round", "sender", "seed_shares", "key_shares")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    SEED_SHARES_FIELD_NUMBER: _ClassVar[int]
    KEY_SHARES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    sender: str
    seed_shares: _containers.RepeatedCompositeFieldContainer[SecAggRevealedShare]
    key_shares: _containers.RepeatedCompositeFieldContainer[SecAggRevealedShare]
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., sender: _Optional[str] = ..., seed_shares: _Optional[_Iterable[_Union[SecAggRevealedShare, _Mapping]]] = ..., key_shares: _Optional[_Iterable[_Union[SecAggRevealedShare, _Mapping]]] = ...) -> None: ...

class SecAggUnmask(_message.Message):
    __slots__ = ("request", "reply")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    request: SecAggUnmaskRequest
    reply: SecAggUnmaskReply
    def __init__(self, request: _Optional[_Union[SecAggUnmaskRequest, _Mapping]] = ..., reply: _Optional[_Union[SecAggUnmaskReply, _Mapping]] = ...) -> None: ...

class Payload(_message.Message):
    __slots__ = ("model_weights", "head_weights", "class_counts", "class_mean_embeddings", "seed_posteriors", "factorized_weights", "criteria_embeddings", "eval_metrics", "peer_weights", "secagg_setup", "secagg_key_advert", "secagg_peer_keys", "secagg_shared_keys", "secagg_peer_shares", "secagg_masked_input", "secagg_unmask")
    MODEL_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    HEAD_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    CLASS_COUNTS_FIELD_NUMBER: _ClassVar[int]
    CLASS_MEAN_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    SEED_POSTERIORS_FIELD_NUMBER: _ClassVar[int]
    FACTORIZED_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    CRITERIA_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    EVAL_METRICS_FIELD_NUMBER: _ClassVar[int]
    PEER_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    SECAGG_SETUP_FIELD_NUMBER: _ClassVar[int]
    SECAGG_KEY_ADVERT_FIELD_NUMBER: _ClassVar[int]
    SECAGG_PEER_KEYS_FIELD_NUMBER: _ClassVar[int]
    SECAGG_SHARED_KEYS_FIELD_NUMBER: _ClassVar[int]
    SECAGG_PEER_SHARES_FIELD_NUMBER: _ClassVar[int]
    SECAGG_MASKED_INPUT_FIELD_NUMBER: _ClassVar[int]
    SECAGG_UNMASK_FIELD_NUMBER: _ClassVar[int]
    model_weights: ModelWeights
    head_weights: HeadWeights
    class_counts: ClassCounts
    class_mean_embeddings: ClassMeanEmbeddings
    seed_posteriors: SeedPosteriors
    factorized_weights: FactorizedWeights
    criteria_embeddings: CriteriaEmbeddings
    eval_metrics: EvalMetrics
    peer_weights: PeerWeights
    secagg_setup: SecAggSetup
    secagg_key_advert: SecAggKeyAdvert
    secagg_peer_keys: SecAggPeerKeys
    secagg_shared_keys: SecAggSharedKeys
    secagg_peer_shares: SecAggPeerShares
    secagg_masked_input: SecAggMaskedInput
    secagg_unmask: SecAggUnmask
    def __init__(self, model_weights: _Optional[_Union[ModelWeights, _Mapping]] = ..., head_weights: _Optional[_Union[HeadWeights, _Mapping]] = ..., class_counts: _Optional[_Union[ClassCounts, _Mapping]] = ..., class_mean_embeddings: _Optional[_Union[ClassMeanEmbeddings, _Mapping]] = ..., seed_posteriors: _Optional[_Union[SeedPosteriors, _Mapping]] = ..., factorized_weights: _Optional[_Union[FactorizedWeights, _Mapping]] = ..., criteria_embeddings: _Optional[_Union[CriteriaEmbeddings, _Mapping]] = ..., eval_metrics: _Optional[_Union[EvalMetrics, _Mapping]] = ..., peer_weights: _Optional[_Union[PeerWeights, _Mapping]] = ..., secagg_setup: _Optional[_Union[SecAggSetup, _Mapping]] = ..., secagg_key_advert: _Optional[_Union[SecAggKeyAdvert, _Mapping]] = ..., secagg_peer_keys: _Optional[_Union[SecAggPeerKeys, _Mapping]] = ..., secagg_shared_keys: _Optional[_Union[SecAggSharedKeys, _Mapping]] = ..., secagg_peer_shares: _Optional[_Union[SecAggPeerShares, _Mapping]] = ..., secagg_masked_input: _Optional[_Union[SecAggMaskedInput, _Mapping]] = ..., secagg_unmask: _Optional[_Union[SecAggUnmask, _Mapping]] = ...) -> None: ...
