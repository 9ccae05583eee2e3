"""Users' code named in the run config's ``reward`` section, registered in this process: verifier
kinds (``tasks/registry.py``), environments (``tasks/environments.py``) and the code behind the
tools tasks bring (``tasks/tool_env.py``). Every role calls this at start, so each knows the same
kinds; where tasks come in, a task naming one that is not registered is refused there."""

from __future__ import annotations

from conveyor.errors import ConfigError
from conveyor.reward_config import RewardConfig
from tasks import environments, registry, tool_env


def register(reward: RewardConfig) -> None:
    """Raises ConfigError naming the entry that cannot be registered (a target that does not import)."""
    try:
        registry.configure(reward.verifiers)
        environments.configure(reward.environments)
        tool_env.configure(reward.tools)
    except registry.RegistryError as exc:
        raise ConfigError(f"invalid config: reward: {exc}") from None
