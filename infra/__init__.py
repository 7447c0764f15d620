"""Adapters: Redis and its keys, locks, the object store, the HTTP client, embedded services."""

# A package of modules: each name is imported from the module that owns it.
__all__: list[str] = []
