"""smdistributed.dataparallel.tensorflow: SageMaker's TensorFlow API, which is smddp.tensorflow."""

from smddp.tensorflow import *  # noqa: F403  (the alias is exactly smddp.tensorflow's public API)
from smddp.tensorflow import __all__ as __all__
