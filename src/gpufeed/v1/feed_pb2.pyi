from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_AUTO: _ClassVar[Transport]
    TRANSPORT_INLINE: _ClassVar[Transport]
    TRANSPORT_SHM: _ClassVar[Transport]
    TRANSPORT_CUDA_IPC: _ClassVar[Transport]

class LabelSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LABELS_FROM_REQUEST: _ClassVar[LabelSource]
    LABELS_FROM_LIST_FILE: _ClassVar[LabelSource]
    LABELS_FROM_FOLDER: _ClassVar[LabelSource]

class Resize(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESIZE_SQUASH: _ClassVar[Resize]
    RESIZE_SHORTER_CENTER_CROP: _ClassVar[Resize]
    RESIZE_RANDOM_RESIZED_CROP: _ClassVar[Resize]

class Layout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LAYOUT_NCHW: _ClassVar[Layout]
    LAYOUT_NHWC: _ClassVar[Layout]

class FailureCategory(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_UNSPECIFIED: _ClassVar[FailureCategory]
    FAILURE_NOT_FOUND: _ClassVar[FailureCategory]
    FAILURE_PERMISSION_DENIED: _ClassVar[FailureCategory]
    FAILURE_UNREADABLE: _ClassVar[FailureCategory]
    FAILURE_UNDECODABLE: _ClassVar[FailureCategory]
    FAILURE_TOO_LARGE: _ClassVar[FailureCategory]
    FAILURE_TIMEOUT: _ClassVar[FailureCategory]
    FAILURE_INTERNAL: _ClassVar[FailureCategory]
    FAILURE_TRANSFORM: _ClassVar[FailureCategory]
TRANSPORT_AUTO: Transport
TRANSPORT_INLINE: Transport
TRANSPORT_SHM: Transport
TRANSPORT_CUDA_IPC: Transport
LABELS_FROM_REQUEST: LabelSource
LABELS_FROM_LIST_FILE: LabelSource
LABELS_FROM_FOLDER: LabelSource
RESIZE_SQUASH: Resize
RESIZE_SHORTER_CENTER_CROP: Resize
RESIZE_RANDOM_RESIZED_CROP: Resize
LAYOUT_NCHW: Layout
LAYOUT_NHWC: Layout
FAILURE_UNSPECIFIED: FailureCategory
FAILURE_NOT_FOUND: FailureCategory
FAILURE_PERMISSION_DENIED: FailureCategory
FAILURE_UNREADABLE: FailureCategory
FAILURE_UNDECODABLE: FailureCategory
FAILURE_TOO_LARGE: FailureCategory
FAILURE_TIMEOUT: FailureCategory
FAILURE_INTERNAL: FailureCategory
FAILURE_TRANSFORM: FailureCategory

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("version", "devices", "transports", "data_roots", "shm_probe", "decode_threads", "gpu_uuid")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    DATA_ROOTS_FIELD_NUMBER: _ClassVar[int]
    SHM_PROBE_FIELD_NUMBER: _ClassVar[int]
    DECODE_THREADS_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    version: str
    devices: _containers.RepeatedScalarFieldContainer[str]
    transports: _containers.RepeatedScalarFieldContainer[Transport]
    data_roots: _containers.RepeatedScalarFieldContainer[str]
    shm_probe: ShmProbe
    decode_threads: int
    gpu_uuid: str
    def __init__(self, version: _Optional[str] = ..., devices: _Optional[_Iterable[str]] = ..., transports: _Optional[_Iterable[_Union[Transport, str]]] = ..., data_roots: _Optional[_Iterable[str]] = ..., shm_probe: _Optional[_Union[ShmProbe, _Mapping]] = ..., decode_threads: _Optional[int] = ..., gpu_uuid: _Optional[str] = ...) -> None: ...

class ShmProbe(_message.Message):
    __slots__ = ("name", "token")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    name: str
    token: bytes
    def __init__(self, name: _Optional[str] = ..., token: _Optional[bytes] = ...) -> None: ...

class ClientMessage(_message.Message):
    __slots__ = ("open", "attached", "release", "deal")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    DEAL_FIELD_NUMBER: _ClassVar[int]
    open: StreamRequest
    attached: Attached
    release: Release
    deal: Deal
    def __init__(self, open: _Optional[_Union[StreamRequest, _Mapping]] = ..., attached: _Optional[_Union[Attached, _Mapping]] = ..., release: _Optional[_Union[Release, _Mapping]] = ..., deal: _Optional[_Union[Deal, _Mapping]] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("files", "list_file", "prefix", "labels", "batch_size", "output", "drop_last", "shuffle", "seed", "epoch", "rank", "world_size", "transport", "prefetch", "start_batch", "max_failures", "max_failure_fraction", "job", "label_source", "clip", "classes", "fields", "sample_transforms", "dealt", "resumed_from", "names", "compression")
    FILES_FIELD_NUMBER: _ClassVar[int]
    LIST_FILE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    DROP_LAST_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    START_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_FAILURES_FIELD_NUMBER: _ClassVar[int]
    MAX_FAILURE_FRACTION_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    LABEL_SOURCE_FIELD_NUMBER: _ClassVar[int]
    CLIP_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_TRANSFORMS_FIELD_NUMBER: _ClassVar[int]
    DEALT_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FROM_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    files: FileList
    list_file: str
    prefix: str
    labels: _containers.RepeatedScalarFieldContainer[int]
    batch_size: int
    output: OutputSpec
    drop_last: bool
    shuffle: bool
    seed: int
    epoch: int
    rank: int
    world_size: int
    transport: Transport
    prefetch: int
    start_batch: int
    max_failures: int
    max_failure_fraction: float
    job: str
    label_source: LabelSource
    clip: ClipSpec
    classes: _containers.RepeatedScalarFieldContainer[str]
    fields: _containers.RepeatedCompositeFieldContainer[FieldSpec]
    sample_transforms: _containers.RepeatedCompositeFieldContainer[SampleTransform]
    dealt: bool
    resumed_from: _containers.RepeatedCompositeFieldContainer[ResumedPhase]
    names: bool
    compression: str
    def __init__(self, files: _Optional[_Union[FileList, _Mapping]] = ..., list_file: _Optional[str] = ..., prefix: _Optional[str] = ..., labels: _Optional[_Iterable[int]] = ..., batch_size: _Optional[int] = ..., output: _Optional[_Union[OutputSpec, _Mapping]] = ..., drop_last: _Optional[bool] = ..., shuffle: _Optional[bool] = ..., seed: _Optional[int] = ..., epoch: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., transport: _Optional[_Union[Transport, str]] = ..., prefetch: _Optional[int] = ..., start_batch: _Optional[int] = ..., max_failures: _Optional[int] = ..., max_failure_fraction: _Optional[float] = ..., job: _Optional[str] = ..., label_source: _Optional[_Union[LabelSource, str]] = ..., clip: _Optional[_Union[ClipSpec, _Mapping]] = ..., classes: _Optional[_Iterable[str]] = ..., fields: _Optional[_Iterable[_Union[FieldSpec, _Mapping]]] = ..., sample_transforms: _Optional[_Iterable[_Union[SampleTransform, _Mapping]]] = ..., dealt: _Optional[bool] = ..., resumed_from: _Optional[_Iterable[_Union[ResumedPhase, _Mapping]]] = ..., names: _Optional[bool] = ..., compression: _Optional[str] = ...) -> None: ...

class ResumedPhase(_message.Message):
    __slots__ = ("world_size", "batches")
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    world_size: int
    batches: int
    def __init__(self, world_size: _Optional[int] = ..., batches: _Optional[int] = ...) -> None: ...

class FieldSpec(_message.Message):
    __slots__ = ("name", "suffix", "tree_from", "tree_to", "max_items")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_FIELD_NUMBER: _ClassVar[int]
    TREE_FROM_FIELD_NUMBER: _ClassVar[int]
    TREE_TO_FIELD_NUMBER: _ClassVar[int]
    MAX_ITEMS_FIELD_NUMBER: _ClassVar[int]
    name: str
    suffix: str
    tree_from: str
    tree_to: str
    max_items: int
    def __init__(self, name: _Optional[str] = ..., suffix: _Optional[str] = ..., tree_from: _Optional[str] = ..., tree_to: _Optional[str] = ..., max_items: _Optional[int] = ...) -> None: ...

class SampleTransform(_message.Message):
    __slots__ = ("name", "params_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    params_json: str
    def __init__(self, name: _Optional[str] = ..., params_json: _Optional[str] = ...) -> None: ...

class ClipSpec(_message.Message):
    __slots__ = ("frames", "stride", "random_start")
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    RANDOM_START_FIELD_NUMBER: _ClassVar[int]
    frames: int
    stride: int
    random_start: bool
    def __init__(self, frames: _Optional[int] = ..., stride: _Optional[int] = ..., random_start: _Optional[bool] = ...) -> None: ...

class FileList(_message.Message):
    __slots__ = ("paths",)
    PATHS_FIELD_NUMBER: _ClassVar[int]
    paths: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, paths: _Optional[_Iterable[str]] = ...) -> None: ...

class OutputSpec(_message.Message):
    __slots__ = ("height", "width", "resize", "shorter_side", "scale_min", "scale_max", "ratio_min", "ratio_max", "flip_probability", "dtype", "mean", "std", "layout")
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    RESIZE_FIELD_NUMBER: _ClassVar[int]
    SHORTER_SIDE_FIELD_NUMBER: _ClassVar[int]
    SCALE_MIN_FIELD_NUMBER: _ClassVar[int]
    SCALE_MAX_FIELD_NUMBER: _ClassVar[int]
    RATIO_MIN_FIELD_NUMBER: _ClassVar[int]
    RATIO_MAX_FIELD_NUMBER: _ClassVar[int]
    FLIP_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    STD_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    height: int
    width: int
    resize: Resize
    shorter_side: int
    scale_min: float
    scale_max: float
    ratio_min: float
    ratio_max: float
    flip_probability: float
    dtype: str
    mean: _containers.RepeatedScalarFieldContainer[float]
    std: _containers.RepeatedScalarFieldContainer[float]
    layout: Layout
    def __init__(self, height: _Optional[int] = ..., width: _Optional[int] = ..., resize: _Optional[_Union[Resize, str]] = ..., shorter_side: _Optional[int] = ..., scale_min: _Optional[float] = ..., scale_max: _Optional[float] = ..., ratio_min: _Optional[float] = ..., ratio_max: _Optional[float] = ..., flip_probability: _Optional[float] = ..., dtype: _Optional[str] = ..., mean: _Optional[_Iterable[float]] = ..., std: _Optional[_Iterable[float]] = ..., layout: _Optional[_Union[Layout, str]] = ...) -> None: ...

class Attached(_message.Message):
    __slots__ = ("lane",)
    LANE_FIELD_NUMBER: _ClassVar[int]
    lane: bool
    def __init__(self, lane: _Optional[bool] = ...) -> None: ...

class Deal(_message.Message):
    __slots__ = ("batches", "last")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    batches: _containers.RepeatedScalarFieldContainer[int]
    last: bool
    def __init__(self, batches: _Optional[_Iterable[int]] = ..., last: _Optional[bool] = ...) -> None: ...

class Release(_message.Message):
    __slots__ = ("seqs", "wait_seconds")
    SEQS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    seqs: _containers.RepeatedScalarFieldContainer[int]
    wait_seconds: float
    def __init__(self, seqs: _Optional[_Iterable[int]] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class ServerMessage(_message.Message):
    __slots__ = ("header", "batch", "on_call")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    ON_CALL_FIELD_NUMBER: _ClassVar[int]
    header: StreamHeader
    batch: Batch
    on_call: OnCall
    def __init__(self, header: _Optional[_Union[StreamHeader, _Mapping]] = ..., batch: _Optional[_Union[Batch, _Mapping]] = ..., on_call: _Optional[_Union[OnCall, _Mapping]] = ...) -> None: ...

class OnCall(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StreamHeader(_message.Message):
    __slots__ = ("transport", "shm_name", "num_slots", "slot_bytes", "num_samples", "num_batches", "cuda_ipc", "classes", "start_batch", "resumed_phases", "dealt", "lane_name", "lane_token")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCHES_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    START_BATCH_FIELD_NUMBER: _ClassVar[int]
    RESUMED_PHASES_FIELD_NUMBER: _ClassVar[int]
    DEALT_FIELD_NUMBER: _ClassVar[int]
    LANE_NAME_FIELD_NUMBER: _ClassVar[int]
    LANE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    transport: Transport
    shm_name: str
    num_slots: int
    slot_bytes: int
    num_samples: int
    num_batches: int
    cuda_ipc: CudaIpc
    classes: _containers.RepeatedScalarFieldContainer[str]
    start_batch: int
    resumed_phases: int
    dealt: bool
    lane_name: str
    lane_token: bytes
    def __init__(self, transport: _Optional[_Union[Transport, str]] = ..., shm_name: _Optional[str] = ..., num_slots: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., num_samples: _Optional[int] = ..., num_batches: _Optional[int] = ..., cuda_ipc: _Optional[_Union[CudaIpc, _Mapping]] = ..., classes: _Optional[_Iterable[str]] = ..., start_batch: _Optional[int] = ..., resumed_phases: _Optional[int] = ..., dealt: _Optional[bool] = ..., lane_name: _Optional[str] = ..., lane_token: _Optional[bytes] = ...) -> None: ...

class CudaIpc(_message.Message):
    __slots__ = ("gpu_uuid", "storage_handle", "storage_size", "storage_offset", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "slot_events")
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    STORAGE_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    SLOT_EVENTS_FIELD_NUMBER: _ClassVar[int]
    gpu_uuid: str
    storage_handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    slot_events: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, gpu_uuid: _Optional[str] = ..., storage_handle: _Optional[bytes] = ..., storage_size: _Optional[int] = ..., storage_offset: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., slot_events: _Optional[_Iterable[bytes]] = ...) -> None: ...

class TensorMeta(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ...) -> None: ...

class SampleFailure(_message.Message):
    __slots__ = ("index", "reason", "category")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    index: int
    reason: str
    category: FailureCategory
    def __init__(self, index: _Optional[int] = ..., reason: _Optional[str] = ..., category: _Optional[_Union[FailureCategory, str]] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("seq", "slot", "tensors", "data", "failures", "compression")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    seq: int
    slot: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    data: bytes
    failures: _containers.RepeatedCompositeFieldContainer[SampleFailure]
    compression: str
    def __init__(self, seq: _Optional[int] = ..., slot: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., data: _Optional[bytes] = ..., failures: _Optional[_Iterable[_Union[SampleFailure, _Mapping]]] = ..., compression: _Optional[str] = ...) -> None: ...
