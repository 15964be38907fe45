"""`KVConnectorFactory`: find connectors through entry points, import only the chosen one.

Connectors are registered in the ``kvtransfer.connectors`` entry-point group, by us and by third
parties alike (``MyConnector = "my_pkg.connector:MyConnector"``). Lookup order:

1. ``kv_connector_module_path`` in the config (vLLM's escape hatch): import that module and take
   the class named ``kv_connector`` from it, no registration needed;
2. the entry point named ``kv_connector``.

The allow/deny policy is checked on the name before anything is imported. The policy comes from
`KVConnectorFactory.set_policy` or, by default, the comma-separated environment variables
``KVTRANSFER_CONNECTORS_ALLOW`` / ``KVTRANSFER_CONNECTORS_DENY``.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from kvtransfer.connector.base import KVConnectorBase_V1
from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.connector.metadata import KVConnectorRole

ENTRY_POINT_GROUP = "kvtransfer.connectors"
ALLOW_ENV = "KVTRANSFER_CONNECTORS_ALLOW"
DENY_ENV = "KVTRANSFER_CONNECTORS_DENY"


class ConnectorLookupError(ValueError):
    """No usable connector under that name (unknown, denied, ambiguous or not a connector)."""


class ConnectorLoadError(ImportError):
    """A connector's code failed to import; the message names its distribution."""


@dataclass(frozen=True)
class ConnectorEntry:
    """One registered connector, as found in the installed distributions' metadata."""

    name: str
    value: str  # "module:Class"
    distribution: str  # "name version", or "<unknown>" for entry points without a dist

    @classmethod
    def from_entry_point(cls, ep: EntryPoint) -> ConnectorEntry:
        dist = ep.dist
        where = f"{dist.name} {dist.version}" if dist is not None else "<unknown>"
        return cls(name=ep.name, value=ep.value, distribution=where)


@dataclass(frozen=True)
class ConnectorPolicy:
    allow: frozenset[str] | None = None  # None: everything not denied
    deny: frozenset[str] = frozenset()

    @classmethod
    def from_env(cls) -> ConnectorPolicy:
        def names(var: str) -> frozenset[str] | None:
            raw = os.environ.get(var)
            if raw is None:
                return None
            return frozenset(n.strip() for n in raw.split(",") if n.strip())

        return cls(allow=names(ALLOW_ENV), deny=names(DENY_ENV) or frozenset())

    def check(self, name: str) -> None:
        if name in self.deny:
            raise ConnectorLookupError(f"connector {name!r} is denied by the connector policy")
        if self.allow is not None and name not in self.allow:
            raise ConnectorLookupError(
                f"connector {name!r} is not in the connector allow list {sorted(self.allow)}"
            )


class KVConnectorFactory:
    _policy: ConnectorPolicy | None = None
    _loaded: dict[tuple[str, str | None], type[KVConnectorBase_V1]] = {}

    @classmethod
    def set_policy(
        cls, allow: set[str] | frozenset[str] | None = None, deny: set[str] | frozenset[str] = ()
    ) -> None:
        """Override the environment's allow/deny lists for this process (``None`` restores
        the environment's)."""
        cls._policy = ConnectorPolicy(
            allow=None if allow is None else frozenset(allow), deny=frozenset(deny)
        )

    @classmethod
    def reset_policy(cls) -> None:
        cls._policy = None

    @classmethod
    def clear_cache(cls) -> None:
        """Forget resolved classes (tests that install and remove distributions need this)."""
        cls._loaded.clear()

    @classmethod
    def policy(cls) -> ConnectorPolicy:
        return cls._policy if cls._policy is not None else ConnectorPolicy.from_env()

    @staticmethod
    def discover() -> dict[str, list[ConnectorEntry]]:
        """Every registered connector name with all its registrations, importing nothing.

        More than one registration under one name is a conflict, reported on lookup.
        """
        found: dict[str, list[ConnectorEntry]] = {}
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            entry = ConnectorEntry.from_entry_point(ep)
            # The same distribution seen twice on sys.path is one registration, not a clash.
            if entry not in found.setdefault(ep.name, []):
                found[ep.name].append(entry)
        return found

    @classmethod
    def get_connector_class_by_name(cls, name: str) -> type[KVConnectorBase_V1]:
        return cls._resolve(name, module_path=None)

    @classmethod
    def get_connector_class(cls, config: KVTransferConfig) -> type[KVConnectorBase_V1]:
        if config.kv_connector is None:
            raise ConnectorLookupError("kv_transfer_config.kv_connector is not set")
        return cls._resolve(config.kv_connector, config.kv_connector_module_path)

    @classmethod
    def create_connector(
        cls,
        config: KVTransferConfig,
        role: KVConnectorRole,
        kv_cache_config: Any | None = None,
    ) -> KVConnectorBase_V1:
        connector_cls = cls.get_connector_class(config)
        return connector_cls(config, KVConnectorRole(role), kv_cache_config)

    @classmethod
    def _resolve(cls, name: str, module_path: str | None) -> type[KVConnectorBase_V1]:
        cls.policy().check(name)
        key = (name, module_path)
        if key in cls._loaded:
            return cls._loaded[key]
        if module_path is not None:
            connector_cls = _load_from_module(name, module_path)
        else:
            connector_cls = _load_registered(name, cls.discover())
        cls._loaded[key] = connector_cls
        return connector_cls


def _load_from_module(name: str, module_path: str) -> type[KVConnectorBase_V1]:
    try:
        module = importlib.import_module(module_path)
    except Exception as exc:
        raise ConnectorLoadError(
            f"kv_connector_module_path {module_path!r} failed to import: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    obj = getattr(module, name, None)
    if obj is None:
        raise ConnectorLookupError(f"module {module_path!r} has no connector class {name!r}")
    return _check_connector_class(obj, f"{module_path}:{name}")


def _load_registered(name: str, found: dict[str, list[ConnectorEntry]]) -> type[KVConnectorBase_V1]:
    entries = found.get(name)
    if not entries:
        known = ", ".join(sorted(found)) or "none"
        raise ConnectorLookupError(
            f"unknown KV connector {name!r}; registered connectors: {known} "
            f"(entry-point group {ENTRY_POINT_GROUP!r})"
        )
    if len(entries) > 1:
        sources = " and ".join(f"{e.value} from {e.distribution}" for e in entries)
        raise ConnectorLookupError(f"KV connector name {name!r} is registered twice: {sources}")
    entry = entries[0]
    module_name, _, attr = entry.value.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split(".") if attr else ():
            obj = getattr(obj, part)
    except Exception as exc:
        raise ConnectorLoadError(
            f"KV connector {name!r} from distribution {entry.distribution} failed to load "
            f"({entry.value}): {type(exc).__name__}: {exc}"
        ) from exc
    return _check_connector_class(obj, f"{entry.value} from {entry.distribution}")


def _check_connector_class(obj: Any, where: str) -> type[KVConnectorBase_V1]:
    if not (isinstance(obj, type) and issubclass(obj, KVConnectorBase_V1)):
        raise ConnectorLookupError(f"{where} is not a KVConnectorBase_V1 subclass: {obj!r}")
    return obj
