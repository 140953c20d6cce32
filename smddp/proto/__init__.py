"""Wire format of smddp: frames, handshake, dtypes and shard layout; pure, no sockets."""

from smddp.proto.dtypes import DType, Kind, ReduceOp, dtype_from_numpy
from smddp.proto.frames import HEADER_SIZE, Header, MsgType, Role, decode_header, encode_header
from smddp.proto.layout import Chunk, shard_bounds, split_range

__all__ = [
    "HEADER_SIZE",
    "Chunk",
    "DType",
    "Header",
    "Kind",
    "MsgType",
    "ReduceOp",
    "Role",
    "decode_header",
    "dtype_from_numpy",
    "encode_header",
    "shard_bounds",
    "split_range",
]
