"""Adapters: Redis and its keys, locks, the object store, the HTTP client, embedded services."""
