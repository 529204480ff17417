"""The ``rivals`` setting: other drafters and transformers' own generation, measured in the same run.

A drafter entry is a drafter config's name (configs/drafter/NAME.yaml), or
``{drafter: NAME, option: value, ...}`` to change its options; a NAME without a YAML (a drafter
registered by a module in ``imports``) takes its factory's defaults. A peer entry is ``hf_NAME`` or
``{peer: hf_NAME, option: value, ...}`` (experiments.run.peers). Every entry is checked before
anything loads.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from drafters import base as drafter_registry
from experiments.cli import SpecdecUserError, require
from experiments.common.config_dir import CONFIG_DIR
from experiments.run.peers import PEERS, check_peer_options


def is_peer(entry: Any) -> bool:
    return (isinstance(entry, dict) and "peer" in entry) or (isinstance(entry, str) and entry in PEERS)


def rival_label(name: str, changed: dict[str, Any]) -> str:
    return name + (f"({', '.join(f'{k}={v}' for k, v in changed.items())})" if changed else "")


def rival_options(entries: list[Any], run_config: DictConfig) -> dict[str, dict[str, Any]]:
    """Each drafter entry's drafter options, by label. Interpolations in a drafter YAML
    (``${batch_size}``) take the run's values, as the run's own drafter's do."""
    known = sorted(path.stem for path in (CONFIG_DIR / "drafter").glob("*.yaml"))
    usage = (f"a rivals entry is a drafter config's name ({', '.join(known)}) or a registered drafter's, "
             f"{{drafter: NAME, option: value}}, a transformers peer ({', '.join(PEERS.names())}) or {{peer: NAME, option: value}}")
    rivals: dict[str, dict[str, Any]] = {}
    scope = OmegaConf.to_container(run_config, resolve=False)
    for entry in (entry for entry in entries if not is_peer(entry)):
        changed = dict(entry) if isinstance(entry, dict) else {"drafter": entry}
        name = changed.pop("drafter", None)
        if name in known:
            scope["drafter"] = OmegaConf.load(CONFIG_DIR / "drafter" / f"{name}.yaml")
            options = OmegaConf.to_container(OmegaConf.create(scope).drafter, resolve=True)
            require(options.get("name") is not None, f"rivals entry {entry!r}: the baseline (no drafter) is always measured")
            unknown = sorted(set(changed) - set(options))
            require(not unknown, f"rivals entry {entry!r}: configs/drafter/{name}.yaml has no option {', '.join(unknown)}")
        else:
            require(isinstance(name, str) and name in drafter_registry.names(), f"rivals entry {entry!r}: {usage}")
            options = {"name": name}
        options.update(changed)
        try:
            drafter_registry.check_options(options["name"], {k: v for k, v in options.items() if k != "name"})
        except ValueError as error:
            raise SpecdecUserError(f"rivals entry {entry!r}: {error}") from error
        label = rival_label(name, changed)
        require(label not in rivals, f"rivals entry {entry!r} is listed twice")
        rivals[label] = options
    return rivals


def peer_options(entries: list[Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    """Each peer entry's (peer name, options), by label."""
    peers: dict[str, tuple[str, dict[str, Any]]] = {}
    for entry in (entry for entry in entries if is_peer(entry)):
        options = dict(entry) if isinstance(entry, dict) else {"peer": entry}
        name = options.pop("peer")
        try:
            check_peer_options(name, options)
        except ValueError as error:
            raise SpecdecUserError(f"rivals entry {entry!r}: {error}") from error
        label = rival_label(name, options)
        require(label not in peers, f"rivals entry {entry!r} is listed twice")
        peers[label] = (name, options)
    return peers
