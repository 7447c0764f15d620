"""What a run is configured with, read and validated before anything is planned.

loading.py    the servers config from `--config` or `--head-server`, in either format of docs/reference/servers-config.md
nemo_gym.py   NeMo Gym's global config, normalised
overrides.py  the collection settings resolved once from base settings, flags and overrides
"""

from producer.config.loading import (
    fetch_head_server_config,
    load_head_server_config,
    load_run_config,
    load_servers_config,
    parse_servers_config,
)
from producer.config.overrides import resolve_settings, validate_settings

__all__ = [
    "fetch_head_server_config",
    "load_head_server_config",
    "load_run_config",
    "load_servers_config",
    "parse_servers_config",
    "resolve_settings",
    "validate_settings",
]
