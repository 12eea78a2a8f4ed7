"""What the engine takes from a client: admission of a request and its link hint, once, at
SGLang's per-request validation."""
