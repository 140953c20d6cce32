"""CUDA buffers on the client: DLPack and CAI reading, the runtime interface and registry, the device copies."""
