"""smdistributed.dataparallel.tensorflow.keras: SageMaker's Keras API, which is smddp.tensorflow.keras."""

from smddp.tensorflow.keras import *  # noqa: F403  (the alias is exactly smddp.tensorflow.keras's API)
from smddp.tensorflow.keras import __all__ as __all__
