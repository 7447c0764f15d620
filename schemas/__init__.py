"""Wire and storage contracts: Pydantic models and pure helpers, no I/O."""
