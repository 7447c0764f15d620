"""`rollouts flower` serves beyond loopback only with authentication, and never puts the broker in argv."""

from __future__ import annotations

import pytest

from producer.ops.control import check_flower_exposure, flower_command
from schemas.errors import UsageError


@pytest.mark.parametrize("address", ["127.0.0.1", "localhost", "::1"])
def test_loopback_needs_no_auth(address: str) -> None:
    check_flower_exposure(address, [], {})


def test_beyond_loopback_without_auth_is_refused_naming_the_way_out() -> None:
    with pytest.raises(UsageError, match=r"--address 0\.0\.0\.0: .*FLOWER_BASIC_AUTH"):
        check_flower_exposure("0.0.0.0", [], {})


@pytest.mark.parametrize(
    ("extra", "env"),
    [
        (["--basic-auth=u:p"], {}),
        (["--basic_auth", "u:p"], {}),
        (["--auth=.*@example.org"], {}),
        ([], {"FLOWER_BASIC_AUTH": "u:p"}),
    ],
)
def test_beyond_loopback_with_auth_is_served(extra: list[str], env: dict[str, str]) -> None:
    check_flower_exposure("0.0.0.0", extra, env)


def test_the_command_line_names_no_broker() -> None:
    cmd = flower_command(5555, "127.0.0.1", ["--purge_offline_workers=60"])
    assert "--broker" not in cmd and "-b" not in cmd
    assert cmd[-3:] == ["--port=5555", "--address=127.0.0.1", "--purge_offline_workers=60"]
