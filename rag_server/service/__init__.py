"""A RAG request end to end: passages (given or retrieved), fitted into the context window, generated."""
