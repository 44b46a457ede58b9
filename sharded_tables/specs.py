"""What a table is and where it can live: dtypes, tiers and ``TableSpec``.

Row storage follows fbgemm's table-batched-embedding (TBE) layout, so one packed row is what the
TBE kernels read, what an embedding server stores and sends, and what a cache holds:

=========  ==========================================  ======================
dtype      packed row (bytes)                          value
=========  ==========================================  ======================
fp32       ``4 D`` float32                              exact
fp16       ``2 D`` float16                              x rounded to fp16
fp8        ``D`` e4m3 codes (fbgemm HFP8, bias 7)       x rounded to e4m3
int8       ``4`` (fp16 scale, fp16 bias) + ``D``        scale * q + bias
int4       ``4`` (fp16 scale, fp16 bias) + ``D / 2``    scale * q + bias
=========  ==========================================  ======================

Example::

    spec = TableSpec("user_id", rows=10_000_000, dim=64, dtype=DType.INT8)
    spec.bytes()  # 680_000_000: 68 bytes a row
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class DType(StrEnum):
    """Storage type of a table's rows (widest first)."""

    FP32 = "fp32"
    FP16 = "fp16"
    FP8 = "fp8"
    INT8 = "int8"
    INT4 = "int4"

    @property
    def has_scale_bias(self) -> bool:
        """Integer rows carry a row-wise fp16 scale and bias (4 bytes in front of the codes)."""
        return self in (DType.INT8, DType.INT4)


DTYPES_WIDEST_FIRST: tuple[DType, ...] = tuple(DType)
SCALE_BIAS_BYTES = 4
FP8_EXPONENT_BITS = 4
FP8_EXPONENT_BIAS = 7


def row_bytes(dim: int, dtype: DType) -> int:
    """Bytes of one packed row of width ``dim`` (see the module table)."""
    if dim < 1:
        raise ValueError(f"dim must be >= 1, got {dim}")
    dtype = DType(dtype)
    if dtype is DType.INT4 and dim % 2:
        raise ValueError(f"int4 rows need an even dim, got {dim}")
    data = {
        DType.FP32: 4 * dim,
        DType.FP16: 2 * dim,
        DType.FP8: dim,
        DType.INT8: dim,
        DType.INT4: dim // 2,
    }[dtype]
    return data + (SCALE_BIAS_BYTES if dtype.has_scale_bias else 0)


class Tier(StrEnum):
    """Where rows live (fastest first).

    * ``device``: GPU memory when a GPU exists; on a CPU-only machine the fastest in-process copy.
    * ``host``: host DRAM of the serving process.
    * ``remote``: CPU DRAM of separate embedding-server processes, read over gRPC.
    """

    DEVICE = "device"
    HOST = "host"
    REMOTE = "remote"


TIERS_FASTEST_FIRST: tuple[Tier, ...] = tuple(Tier)


@dataclass(frozen=True)
class TableSpec:
    """One embedding table as the model needs it (before placement)."""

    name: str
    rows: int
    """Rows; ids are ``[0, rows)`` unless ``hashed`` (then rows is the local capacity)."""
    dim: int
    dtype: DType = DType.FP32
    """Preferred (widest acceptable) storage type; the planner may narrow it within ``allowed``."""
    pooling: str = "mean"
    """``"mean"`` or ``"sum"`` over the ids of one sample."""
    expected_hit_rate: float = 0.9
    """Share of this table's lookups that a hot-row cache of ``cache_fraction`` rows catches
    (skew of the id distribution); the planner gives remote tables a cache when it is high."""
    lookups_per_sample: float = 1.0
    """Mean ids per sample (pooling factor); hotness for the planner is lookups per byte."""
    allowed_dtypes: tuple[DType, ...] = ()
    """Dtypes the planner may use (default: ``dtype`` only, i.e. never quantize further)."""
    features: tuple[str, ...] = field(default_factory=tuple)
    """Feature names that read this table (default: the table's own name)."""
    hashed: bool = False
    """Raw 64-bit ids mapped to rows by an id transformer (unbounded id space)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DType(self.dtype))
        object.__setattr__(self, "allowed_dtypes", tuple(DType(d) for d in self.allowed_dtypes))
        if not self.name:
            raise ValueError("table name must not be empty")
        if self.rows < 1:
            raise ValueError(f"table {self.name!r}: rows must be >= 1, got {self.rows}")
        if self.pooling not in ("mean", "sum"):
            raise ValueError(
                f"table {self.name!r}: pooling must be 'mean' or 'sum', got {self.pooling!r}"
            )
        if not 0.0 <= self.expected_hit_rate <= 1.0:
            raise ValueError(f"table {self.name!r}: expected_hit_rate must be in [0, 1]")
        for d in self.dtypes():
            try:
                row_bytes(self.dim, d)
            except ValueError as e:
                raise ValueError(f"table {self.name!r}: {e}") from None

    def feature_names(self) -> tuple[str, ...]:
        return self.features or (self.name,)

    def dtypes(self) -> tuple[DType, ...]:
        """Dtypes the planner may choose, widest first (``dtype`` always included)."""
        chosen = set(self.allowed_dtypes) | {self.dtype}
        return tuple(d for d in DTYPES_WIDEST_FIRST if d in chosen)

    def row_bytes(self, dtype: DType | None = None) -> int:
        return row_bytes(self.dim, dtype or self.dtype)

    def bytes(self, dtype: DType | None = None) -> int:
        """Bytes of the whole table at ``dtype`` (default: its own)."""
        return self.rows * self.row_bytes(dtype)
