"""picrag's attention backends: masked by true position, on CPU (native) and CUDA (FlashInfer)."""
