"""Wire and storage contracts: Pydantic models and pure helpers, no I/O."""

# A package of modules: each name is imported from the module that owns it.
__all__: list[str] = []
