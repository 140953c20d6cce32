"""smdistributed.dataparallel.torch: PyTorch entry points (`torch_smddp`, `distributed`, `parallel`)."""
