"""The TensorFlow front end's argument errors: smddp.errors' own, made to keep their type through tf.function."""

from __future__ import annotations

from smddp import errors


class InvalidArgumentError(errors.InvalidArgumentError):
    """smddp.errors.InvalidArgumentError as the TensorFlow front end raises it; nothing was sent.

    While a tf.function is traced, AutoGraph re-raises an exception that crosses the converted user
    code as its own type only if the type's __init__ is Exception's, and as a StagingError
    otherwise (ValueError's __init__ does not qualify). With Exception's __init__ the caller can
    still catch smddp.errors.InvalidArgumentError, inside tf.function as outside.
    """

    __init__ = Exception.__init__


class UnsupportedBufferError(errors.UnsupportedBufferError):
    """smddp.errors.UnsupportedBufferError (a tensor's dtype smddp does not carry), as InvalidArgumentError here."""

    __init__ = Exception.__init__
