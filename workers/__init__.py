"""The Celery side: the app, thin tasks, and the logic they run (calling agents, landing, finishing)."""
