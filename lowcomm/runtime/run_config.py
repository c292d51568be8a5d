"""The run config on the control plane: the coordinator publishes it signed, peers fetch and check it.

The transport signs and verifies the record but knows nothing of what a run config is (it sits
below the config's components); here the JSON is parsed into a RunConfig and checked against
the hash the coordinator signed with it.
"""

from __future__ import annotations

from lowcomm.config import ConfigError, RunConfig
from lowcomm.transport.control import ConfigRejected, ControlPlane


def publish_run_config(control: ControlPlane, config: RunConfig, version: int, ttl: float,
                       epoch: float = 0.0) -> None:
    control.publish_config(config.to_json(), config.config_hash(), version, ttl, epoch=epoch)


def fetch_run_config(control: ControlPlane, coordinator_marker: bytes,
                     timeout: float = 15.0) -> tuple[RunConfig, int]:
    """The run config signed by the coordinator's key, and its version; ConfigRejected if unusable."""
    signed = control.fetch_config(coordinator_marker, timeout)
    try:
        config = RunConfig.from_json(signed.text)
    except ConfigError as e:
        raise ConfigRejected(f"the coordinator's run config is invalid: {e}") from None
    if config.config_hash() != signed.hash:
        raise ConfigRejected("the run config's hash does not match its contents")
    return config, signed.version
