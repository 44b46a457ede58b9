"""What a served model looks like to the KServe v2 / Triton protocol: its tensors
(:class:`TensorSpec`, :class:`ModelSpec`), its metadata and its ``config.pbtxt`` (see
:mod:`serving.frontends.kserve` for the whole flow)."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from serving.engine.client import ModelInfo
from serving.engine.state import ServingState
from serving.limits import LimitsConfig
from serving.types import (
    DATATYPES,
    OUTPUTS,
    RAW_INPUTS,
    RAW_OUTPUTS,
    STORE_INPUTS,
    RequestError,
)

SERVER_NAME = "recserve"
EXTENSIONS = ("binary_tensor_data", "model_configuration", "parameters")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the interface; ``dims`` exclude the batch dim (``-1``: any size)."""

    name: str
    datatype: str
    dims: tuple[int, ...]
    optional: bool = False


@dataclass(frozen=True)
class ModelSpec:
    """What parsing needs to know of the loaded model."""

    name: str
    version: int
    categorical: int
    """F: categorical user features."""
    dense: int
    """Dd: dense user features."""
    max_k: int
    """Largest K a request may ask for (``MAX_K``, items in the index)."""
    max_batch_size: int
    """Most rows (B) in one call, as Triton enforces ``max_batch_size``."""
    platform: str = "pytorch"
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    """Request size limits (``[limits]``): a filter is checked against them before parsing."""
    raw_ids: bool = False
    seen_store: bool = False
    """The model keeps a seen store: the optional ``user`` input (``serving/types.py``)."""
    """The model has id maps: ``raw_history`` / ``raw_seen`` in, ``raw_item_ids`` out
    (``history`` optional)."""

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        raw = tuple(TensorSpec(n, DATATYPES[n], (-1,), optional=True) for n in RAW_INPUTS)
        return (
            TensorSpec("history", DATATYPES["history"], (-1,), optional=self.raw_ids),
            TensorSpec("categorical", DATATYPES["categorical"], (self.categorical,)),
            TensorSpec("dense", DATATYPES["dense"], (self.dense,)),
            TensorSpec("k", DATATYPES["k"], (1,)),
            TensorSpec("filter", DATATYPES["filter"], (1,), optional=True),
            TensorSpec("seen", DATATYPES["seen"], (-1,), optional=True),
            *(raw if self.raw_ids else ()),
            *(
                TensorSpec(n, DATATYPES[n], (1,), optional=True)
                for n in STORE_INPUTS
                if self.seen_store
            ),
        )

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        names = OUTPUTS + RAW_OUTPUTS if self.raw_ids else OUTPUTS
        return tuple(TensorSpec(name, DATATYPES[name], (-1,)) for name in names)


# ---- the model ---------------------------------------------------------------------------------
def resolve(state: ServingState, model: str, version: str) -> ModelSpec:
    """The spec of the loaded model if ``model`` / ``version`` (``""``: the latest) name it;
    raises :class:`ModelNotFoundError` or :class:`RequestError` (a version that is no number)."""
    # at most 18 digits: an int64, and int() refuses over 4300 digits with a ValueError
    if version and not (version.isascii() and version.isdigit() and len(version) <= 18):
        raise RequestError(f"version: {short_repr(version)} is not a version number")
    info = state.engine.info()  # UnavailableError before the first version loads
    info.check_target(model, int(version) if version else None)
    return model_spec(state, info)


def model_spec(state: ServingState, info: ModelInfo | None = None) -> ModelSpec:
    """The spec of the served version (``info``: as the engine described it, read now when
    None)."""
    info = state.engine.info() if info is None else info
    return ModelSpec(
        name=info.name,
        version=info.version,
        categorical=info.categorical,
        dense=info.dense,
        max_k=info.max_k,
        max_batch_size=info.policy.max_batch_size,
        platform=info.platform or "pytorch",
        limits=state.limits,
        raw_ids=info.raw_ids,
        seen_store=info.seen_store,
    )


def loaded_config(state: ServingState) -> mc.ModelConfig | None:
    """The served version's ``config.pbtxt``; None before a version loads or without one (an
    engine in another process sends it serialized)."""
    if not state.engine.ready:
        return None
    config = state.engine.info().config
    if isinstance(config, bytes):
        config = mc.ModelConfig.FromString(config)
    return config if isinstance(config, mc.ModelConfig) else None


def model_config(state: ServingState, spec: ModelSpec) -> mc.ModelConfig:
    """The loaded version's ``config.pbtxt``; one built from the interface when it has none."""
    config = loaded_config(state)
    if config is not None:
        return config
    policy = state.engine.info().policy

    def tensor(t: TensorSpec) -> dict[str, Any]:
        dt = "TYPE_STRING" if t.datatype == "BYTES" else f"TYPE_{t.datatype}"
        return {"name": t.name, "data_type": mc.DataType.Value(dt), "dims": list(t.dims)}

    return mc.ModelConfig(
        name=spec.name,
        platform=spec.platform,
        max_batch_size=spec.max_batch_size,
        input=[mc.ModelInput(**tensor(t), optional=t.optional) for t in spec.inputs],
        output=[mc.ModelOutput(**tensor(t)) for t in spec.outputs],
        dynamic_batching=mc.ModelDynamicBatching(
            preferred_batch_size=list(policy.preferred_sizes),
            max_queue_delay_microseconds=round(policy.max_queue_delay_s * 1e6),
            default_queue_policy=mc.ModelQueuePolicy(max_queue_size=policy.max_queue_size),
        ),
    )


def server_version() -> str:
    try:
        return metadata.version(SERVER_NAME)
    except metadata.PackageNotFoundError:
        return "0"


def short_repr(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."
