# Patterns nanobind's stubgen applies to smddp/_engine.pyi (make stubs): what it cannot see or says wrong.

# The buffer protocol (Py_bf_getbuffer): a type checker knows it by __buffer__.
smddp._engine.Segment.close_fd:
    def close_fd(self) -> None:
        """The fd goes now, the mapping with its last holder."""

    def __buffer__(self, flags: int, /) -> memoryview: ...

# A one-field record's __match_args__ (stubgen writes the tuple without its comma).
smddp._engine.Unmatched.__match_args__:
    __match_args__: tuple = ('header',)

# The private members are the bindings' own (-P: _client, _value, _complete), not enum's internals.
smddp._engine.RunEnd._\w+:
