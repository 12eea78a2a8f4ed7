"""The HTTP edge: the FastAPI app, its routes, request validation, admission and the API key."""
