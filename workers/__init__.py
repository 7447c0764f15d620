"""The Celery side: the app, thin tasks, and the logic they run (calling agents, landing, finishing)."""

# A package of modules: each name is imported from the module that owns it.
__all__: list[str] = []
