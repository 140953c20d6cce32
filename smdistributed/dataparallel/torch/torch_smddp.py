"""Importing this registers torch.distributed backend "smddp", as SageMaker's `torch_smddp` module does."""

import smddp.torch  # noqa: F401  (the import registers the backend)
