"""TensorFlow tensors on smddp's collectives: direct calls when eager, numpy_function ops in graphs."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np
import tensorflow as tf

import smddp
from smddp.client.session import Handle
from smddp.tensorflow.compression import Compression, Compressor
from smddp.tensorflow.errors import InvalidArgumentError, UnsupportedBufferError


class ReduceOp(enum.Enum):
    """How allreduce combines the ranks' tensors (SageMaker's names; Horovod's are aliases below)."""

    AVERAGE = "average"
    SUM = "sum"
    MIN = "min"
    MAX = "max"

    @property
    def smddp_op(self) -> smddp.ReduceOp:
        return _SMDDP_OPS[self]


_SMDDP_OPS = {
    ReduceOp.AVERAGE: smddp.AVG,
    ReduceOp.SUM: smddp.SUM,
    ReduceOp.MIN: smddp.MIN,
    ReduceOp.MAX: smddp.MAX,
}

# Horovod's spellings, so that `op=hvd.Average`-style scripts need only the import changed.
Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX

# What smddp reduces (smddp.proto.dtypes); a broadcast moves bytes, so it takes every fixed-size dtype.
REDUCIBLE_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64, tf.uint8)
BROADCASTABLE_DTYPES = (
    *REDUCIBLE_DTYPES,
    tf.bool,
    tf.int8,
    tf.int16,
    tf.uint16,
    tf.uint32,
    tf.uint64,
    tf.complex64,
    tf.complex128,
)


_F = TypeVar("_F", bound=Callable[..., Any])


def no_autograph(fn: _F) -> _F:
    """Keep AutoGraph out: called from a tf.function, this is plain Python that builds ops, as TF's own are."""
    return tf.autograph.experimental.do_not_convert(fn)


def check_op(op: Any) -> ReduceOp:
    """`op` as a ReduceOp: a ReduceOp, smddp's SUM/AVG/MIN/MAX, or None (average)."""
    if op is None:
        return ReduceOp.AVERAGE
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, smddp.ReduceOp):
        return next(k for k, v in _SMDDP_OPS.items() if v == op)
    raise InvalidArgumentError(f"op must be smddp.tensorflow.ReduceOp.AVERAGE, SUM, MIN or MAX, got {op!r}")


def check_compression(compression: Any) -> type[Compressor]:
    if not (
        callable(getattr(compression, "compress", None))
        and callable(getattr(compression, "decompress", None))
    ):
        raise InvalidArgumentError(
            f"compression must be Compression.none, Compression.fp16 or a Compressor, got {compression!r}"
        )
    return compression


def check_root(root_rank: Any) -> int:
    world = smddp.size()  # raises NotInitializedError before init()
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)):
        raise InvalidArgumentError(f"root_rank must be an int rank, got {root_rank!r}")
    if not 0 <= int(root_rank) < world:
        raise InvalidArgumentError(f"root_rank {root_rank} is out of range for {world} ranks")
    return int(root_rank)


def fusion_bytes(bucket_cap_mb: float | None) -> int:
    """The fusion-buffer size in bytes: `bucket_cap_mb`, else smddp's (smddp-launch --fusion-mb)."""
    if bucket_cap_mb is None:
        return smddp.client().config.fusion_bytes
    if (
        isinstance(bucket_cap_mb, bool)
        or not isinstance(bucket_cap_mb, (int, float))
        or not bucket_cap_mb > 0
    ):
        raise InvalidArgumentError(f"bucket_cap_mb must be a positive number of MiB, got {bucket_cap_mb!r}")
    return max(1, int(bucket_cap_mb * (1 << 20)))


def _check_dtype(t: tf.Tensor, allowed: Sequence[tf.DType], what: str) -> None:
    if t.dtype not in allowed:
        names = ", ".join(d.name for d in allowed)
        raise UnsupportedBufferError(
            f"{what}: tensor {_describe(t)} has dtype {t.dtype.name}, which smddp does not carry "
            f"(supported: {names}); nothing was sent"
        )


def _describe(t: Any) -> str:
    name = getattr(t, "name", None) if not tf.executing_eagerly() else None
    return f"{name!r} of shape {t.shape}" if name else f"of shape {t.shape}"


def _refuse_xla() -> None:
    """numpy_function cannot be compiled by XLA: say so while tracing, instead of TF's error at run time."""
    from tensorflow.python.ops import control_flow_util  # not in tf's public API

    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise InvalidArgumentError(
            "smddp collectives cannot run inside an XLA-compiled function (jit_compile=True): "
            "use tf.function(jit_compile=False), or model.compile(..., jit_compile=False) with Keras"
        )


class _Fused:
    """One fusion buffer: packs its tensors, submits one collective, unpacks the result on wait.

    The numpy_function ops of a graph call `submit` and `wait` with the collective's sequence number
    as the token between them, so one traced graph may run several times, even concurrently.
    """

    def __init__(self, kind: str, op: smddp.ReduceOp, root: int, as_bytes: bool) -> None:
        self.kind = kind
        self.op = op
        self.root = root
        self.as_bytes = as_bytes  # broadcast moves raw bytes: any fixed-size dtype, one buffer for all
        self._pending: dict[int, tuple[Handle, list[tuple[tuple[int, ...], np.dtype]]]] = {}

    def submit(self, *arrays: np.ndarray) -> np.int64:
        layout = [(a.shape, a.dtype) for a in arrays]
        # The arrays may be TF's own memory: the client copies each straight into shared memory and
        # hands back the result in a new array, so nothing is packed here and no input is written.
        parts = [np.ascontiguousarray(a).reshape(-1) for a in arrays]
        if self.as_bytes:
            parts = [p.view(np.uint8) for p in parts]
        if self.kind == "allreduce":
            h = smddp.allreduce_parts_async(parts, self.op)
        else:
            h = smddp.broadcast_parts_async(parts, self.root)
        self._pending[h.seq] = (h, layout)
        return np.int64(h.seq)

    def wait(self, token: Any) -> list[np.ndarray]:
        h, layout = self._pending.pop(int(token))
        flat = h.wait()
        out: list[np.ndarray] = []
        at = 0
        for shape, dt in layout:
            n = math.prod(shape) * (dt.itemsize if self.as_bytes else 1)
            piece = flat[at : at + n]
            at += n
            out.append((piece.view(dt) if self.as_bytes else piece).reshape(shape))
        return out


def _plan(tensors: Sequence[tf.Tensor], cap: int, by_dtype: bool) -> list[list[int]]:
    """Fusion buffers of at most `cap` bytes (or one tensor), one dtype each, in order of first member."""
    buckets: list[list[int]] = []
    open_: dict[Any, tuple[list[int], int]] = {}  # dtype -> (the buffer being filled, its bytes)
    for i, t in enumerate(tensors):
        key = t.dtype if by_dtype else None
        n = t.shape.num_elements()
        nbytes = cap if n is None else n * t.dtype.size  # an unknown size gets a buffer of its own
        cur = open_.get(key)
        if cur is None or cur[1] + nbytes > cap:
            members: list[int] = []
            used = 0
            buckets.append(members)
        else:
            members, used = cur
        members.append(i)
        open_[key] = (members, used + nbytes)
    return buckets


def run_fused(
    tensors: Sequence[tf.Tensor], kind: str, op: smddp.ReduceOp, root: int, cap: int
) -> list[tf.Tensor]:
    """Allreduce or broadcast `tensors` in fusion buffers: every buffer submitted, then all awaited.

    Every rank must call this with tensors of the same dtypes and sizes in the same order. Eagerly
    the collectives run now; in a graph (tf.function, or a TF1 graph) the submit ops are chained with
    control dependencies, so every rank issues them in the same order whatever the executor does.
    """
    if not tensors:
        return []
    as_bytes = kind == "broadcast"
    buckets = _plan(tensors, cap, by_dtype=not as_bytes)
    fused = [_Fused(kind, op, root, as_bytes) for _ in buckets]
    out: list[Any] = [None] * len(tensors)
    if tf.executing_eagerly():
        tokens = [f.submit(*[tensors[i].numpy() for i in b]) for f, b in zip(fused, buckets, strict=True)]
        for f, b, tok in zip(fused, buckets, tokens, strict=True):
            for i, a in zip(b, f.wait(tok), strict=True):
                out[i] = tf.convert_to_tensor(a, dtype=tensors[i].dtype)
        return out
    _refuse_xla()
    graph_tokens: list[tf.Tensor] = []
    for f, b in zip(fused, buckets, strict=True):
        with tf.control_dependencies(graph_tokens[-1:]):
            tok = tf.numpy_function(
                f.submit, [tensors[i] for i in b], tf.int64, stateful=True, name=f"smddp_{kind}_submit"
            )
        tok.set_shape([])
        graph_tokens.append(tok)
    for f, b, tok in zip(fused, buckets, graph_tokens, strict=True):
        res = tf.numpy_function(
            f.wait, [tok], [tensors[i].dtype for i in b], stateful=True, name=f"smddp_{kind}_wait"
        )
        for i, r in zip(b, res, strict=True):
            r.set_shape(tensors[i].shape)
            out[i] = r
    return out


@no_autograph
def allreduce(
    tensor: Any,
    param_index: int = 0,
    num_params: int = 1,
    compression: Any = Compression.none,
    op: Any = ReduceOp.AVERAGE,
    name: str | None = None,
) -> tf.Tensor:
    """All-reduce one tensor across every rank (average by default); returns a new tensor.

    `param_index` and `num_params` are SageMaker's API (the tensor's place in a list being reduced);
    they are checked and otherwise unused: every call is one collective. Works eagerly and in tf.function.
    """
    del name  # Horovod's op name: the graph op is named smddp_allreduce_*
    for arg, value in (("param_index", param_index), ("num_params", num_params)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgumentError(f"{arg} must be an int, got {value!r}")
    if not 0 <= param_index < num_params:
        raise InvalidArgumentError(f"param_index {param_index} is out of range for num_params={num_params}")
    rop = check_op(op)
    comp = check_compression(compression)
    smddp.size()  # NotInitializedError now, not inside a graph at run time
    t = tf.convert_to_tensor(tensor)
    sent, ctx = comp.compress(t)
    _check_dtype(sent, REDUCIBLE_DTYPES, "allreduce")
    (res,) = run_fused([sent], "allreduce", rop.smddp_op, 0, cap=1 << 62)
    return comp.decompress(res, ctx)


@no_autograph
def oob_allreduce(tensor: Any, compression: Any = Compression.none, op: Any = ReduceOp.AVERAGE) -> tf.Tensor:
    """SageMaker's out-of-band all-reduce (for metrics such as the loss): the same as `allreduce`."""
    return allreduce(tensor, compression=compression, op=op)


@no_autograph
def broadcast(tensor: Any, root_rank: int, name: str | None = None) -> tf.Tensor:
    """Root's `tensor` on every rank: a new tensor of the same shape and dtype."""
    del name
    root = check_root(root_rank)
    t = tf.convert_to_tensor(tensor)
    _check_dtype(t, BROADCASTABLE_DTYPES, "broadcast")
    (res,) = run_fused([t], "broadcast", smddp.SUM, root, cap=1 << 62)
    return res


@no_autograph
def reduce_tensors(
    tensors: Sequence[Any], op: Any, compression: Any, cap: int, what: str = "gradient"
) -> list[Any]:
    """All-reduce a list of gradients in fusion buffers of `cap` bytes; None entries stay None.

    Buffers are filled from the end of the list (the last layers' gradients are ready first in a
    backward pass, so in a graph their collective can start while earlier gradients are computed).
    Sparse gradients (tf.IndexedSlices) are made dense.
    """
    rop = check_op(op)
    comp = check_compression(compression)
    smddp.size()
    idx = [i for i in reversed(range(len(tensors))) if tensors[i] is not None]
    sent: list[tf.Tensor] = []
    ctxs: list[Any] = []
    for i in idx:
        t, ctx = comp.compress(tf.convert_to_tensor(tensors[i]))
        _check_dtype(t, REDUCIBLE_DTYPES, f"{what} {i}")
        sent.append(t)
        ctxs.append(ctx)
    out = list(tensors)
    for i, r, ctx in zip(idx, run_fused(sent, "allreduce", rop.smddp_op, 0, cap), ctxs, strict=True):
        out[i] = comp.decompress(r, ctx)
    return out


def _read(v: Any) -> tf.Tensor:
    return tf.convert_to_tensor(v)  # tf.Variable and Keras 3 variables alike


@no_autograph
def broadcast_variables(variables: Iterable[Any], root_rank: int, bucket_cap_mb: float | None = None) -> Any:
    """Assign root's values to `variables` on every rank (fused: one broadcast per fusion buffer).

    Every rank must pass the same variables (shapes and dtypes) in the same order, e.g.
    `model.variables` and then `optimizer.variables`. Returns None, except in a TF1 graph: there
    the op that does it, to run (a tf.function runs it by itself, in program order).
    """
    root = check_root(root_rank)
    vs = list(variables)
    values = [_read(v) for v in vs]
    for i, t in enumerate(values):
        _check_dtype(t, BROADCASTABLE_DTYPES, f"broadcast_variables: variable {i} ({_var_name(vs[i])})")
    new = run_fused(values, "broadcast", smddp.SUM, root, fusion_bytes(bucket_cap_mb))
    if smddp.rank() == root:
        assigns = []  # root's values are already in place; its broadcasts still ran above
    else:
        assigns = [_assign(v, n) for v, n in zip(vs, new, strict=True)]
    if tf.executing_eagerly() or tf.inside_function():
        return None  # a tf.function runs the assignments in program order; it must not return an op
    return tf.group(*[a for a in assigns if isinstance(a, (tf.Tensor, tf.Operation))], *new)


def _assign(v: Any, value: tf.Tensor) -> Any:
    if isinstance(v, tf.Variable):
        return v.assign(value, read_value=False)  # the assign op itself, for tf.group in a TF1 graph
    return v.assign(value)  # a Keras 3 variable


def _var_name(v: Any) -> str:
    return str(getattr(v, "path", None) or getattr(v, "name", None) or type(v).__name__)


@no_autograph
def broadcast_global_variables(root_rank: int) -> Any:
    """The TF1 API: an op that broadcasts `tf.compat.v1.global_variables()` from root (graph mode only)."""
    if tf.executing_eagerly() or tf.inside_function():
        raise InvalidArgumentError(
            "broadcast_global_variables() needs a TF1 graph (there are no global variables in eager "
            "mode or a tf.function): use broadcast_variables(model.variables, root_rank) instead"
        )
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


@no_autograph
def overlap(tensor: Any) -> tf.Tensor:
    """SageMaker's XLA overlap marker: an identity (smddp reduces outside XLA, so there is nothing to mark)."""
    return tf.identity(tensor)
