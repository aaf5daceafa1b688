"""Reaching the Kubernetes API: a kubernetes_asyncio ``Configuration`` (server, TLS, credentials) and
the namespace to watch, for one of three modes (``_access``, first match):

- ``api_url``, with ``token_file`` and ``ca_file`` (else the service account's CA when mounted, else
  the system's CAs: an API behind a public certificate);
- a kubeconfig (``kubeconfig``, or ``$KUBECONFIG`` when not in a cluster), read by kubernetes_asyncio's
  own loader: its current context's server, CA, ``insecure-skip-tls-verify``, token, ``tokenFile``,
  client certificate or ``exec`` credential plugin (e.g. ``aws eks get-token``), and namespace;
- in-cluster: ``KUBERNETES_SERVICE_HOST``/``_PORT`` and the service account's token, CA and namespace.

A CA file the config names must exist (config validation checks it, ``check_files``), and so must the
service account's CA in-cluster: no silent fallback to the system CAs, which cannot verify a cluster's
own CA. Everything here that reads files (the kubeconfig, the CA, the namespace) or runs an exec
plugin the first time runs on a worker thread (``_access`` is blocking; the watcher calls it there).

**Credentials stay fresh** through the client's ``refresh_api_key_hook``, which kubernetes_asyncio
awaits before every request. A token file (``token_file``, a kubeconfig's ``tokenFile``, the service
account's projected token, which the kubelet rotates) is re-read there, on a worker thread, so a
rotated token is used from the next request on. (The library's own in-cluster loader re-reads the
token only once a minute, and on the event loop: not used.) An exec credential comes from the
library's ``KubeConfigLoader.load_from_exec_plugin``, which keeps the plugin's token until 5 minutes
before its ``expirationTimestamp`` and then runs the plugin again (as a subprocess, without blocking
the loop); a plugin that gives no expiry is run before every request.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes_asyncio.client import Configuration
from kubernetes_asyncio.config.config_exception import ConfigException
from kubernetes_asyncio.config.exec_provider import ExecProvider
from kubernetes_asyncio.config.kube_config import ConfigNode, KubeConfigLoader, KubeConfigMerger

from gateway.config import DiscoveryConfig

log = logging.getLogger("gateway.engines.discovery")

_BEARER = "BearerToken"  # the client's name for the Authorization header's credential
# What reading a kubeconfig raises: the library's loaders assume a well-formed document (anything
# else fails in a Python error), YAML that does not parse, a file that cannot be read.
_MALFORMED = (ConfigException, OSError, ValueError, yaml.YAMLError, AttributeError, TypeError, KeyError)
_REFUSED_AUTH = ("auth-provider", "username", "password")  # removed from kubectl / the API server


class AccessError(ValueError):
    """API access cannot be set up; ``field`` is the discovery key at fault (for the message's
    location, ``pools.<pool>.discovery.<field>``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Access:
    """The client's configuration (credentials refreshed by its hook) and the namespace to watch."""

    configuration: Configuration
    namespace: str
    token_file: str | None = None  # re-read before every request


@dataclass(frozen=True)
class Kubeconfig:
    """A kubeconfig's current context, checked (files named exist, auth supported), not yet loaded."""

    loader: KubeConfigLoader
    namespace: str | None
    token_file: str | None  # the user's tokenFile, resolved: re-read, and preferred to ``token`` (client-go)
    exec_plugin: bool


def _read(path: str) -> str:
    return Path(path).read_text(encoding="utf-8").strip()


def _explicit(cfg: DiscoveryConfig, field: str) -> str | None:
    """The file ``cfg`` names for ``field`` when it is not the service account's default."""
    value = getattr(cfg, field)
    return value if value is not None and value != type(cfg).model_fields[field].default else None


def check_files(cfg: DiscoveryConfig) -> list[tuple[str, str]]:
    """What config validation checks (environment-independent): the files the config itself
    names. ``(field, message)`` per problem. Blocking (reads the kubeconfig; runs no plugin)."""
    errors: list[tuple[str, str]] = []
    if cfg.api_url and cfg.kubeconfig:
        errors.append(("kubeconfig", "set api_url or kubeconfig, not both"))
    if (ca := _explicit(cfg, "ca_file")) and not Path(ca).is_file():
        errors.append(("ca_file", f"{ca} does not exist"))
    if cfg.kubeconfig:
        try:
            read_kubeconfig([cfg.kubeconfig])
        except ValueError as err:
            errors.append(("kubeconfig", str(err)))
    return errors


def read_kubeconfig(paths: Sequence[str]) -> Kubeconfig:
    """The current context of the kubeconfig ``paths``, merged by kubernetes_asyncio's
    ``KubeConfigMerger`` (the first file to define a name wins) with kubectl's ``current-context``
    (the first file's to set one; the library would take the last's). Raises ValueError saying what
    is wrong: a missing file, not a kubeconfig, no such context, cluster or user, no http(s) server,
    a file it names missing, a malformed exec section, or auth-provider / basic auth (unsupported)."""
    where = ", ".join(paths)
    for path in paths:
        if not Path(path).expanduser().is_file():
            raise ValueError(f"{path} does not exist")
    try:
        merger = KubeConfigMerger(":".join(str(Path(p).expanduser()) for p in paths))
        if (config := merger.config) is None:
            raise ConfigException("no kubeconfig loaded")
        current = next((c["current-context"] for c in merger.config_files.values() if c.get("current-context")), None)
        config.value["current-context"] = current
        loader = KubeConfigLoader(config_dict=config, config_base_path=None)
        context = _entry(config, "contexts", current)
        cluster = _entry(config, "clusters", context["cluster"])
        user = _entry(config, "users", context["user"]) if context.safe_get("user") else None
        if user is not None and user.safe_get("exec"):
            ExecProvider(user["exec"])  # checks command, apiVersion and args; runs nothing
    except _MALFORMED as err:
        raise ValueError(f"{where}: not a usable kubeconfig ({type(err).__name__}: {err})") from None
    server = cluster.safe_get("server")
    if not isinstance(server, str) or not server.startswith(("https://", "http://")):
        raise ValueError(f"{where}: the cluster of context {current!r} has no http(s) server")
    user_value: dict[str, Any] = user.value if user is not None else {}
    if bad := [k for k in _REFUSED_AUTH if user_value.get(k)]:
        raise ValueError(
            f"{where}: the user of context {current!r} authenticates with {'/'.join(bad)}, which pdgate "
            "does not support: give it a token, tokenFile, client certificate or exec plugin"
        )
    files = {key: _named_file(user, key, where) for key in ("client-certificate", "client-key", "tokenFile")}
    _named_file(cluster, "certificate-authority", where)
    cert, key = (files[k] or user_value.get(f"{k}-data") for k in ("client-certificate", "client-key"))
    if bool(cert) != bool(key):
        raise ValueError(f"{where}: the user of context {current!r} has a client certificate or key without the other")
    return Kubeconfig(loader, context.safe_get("namespace") or None, files["tokenFile"], bool(user_value.get("exec")))


def _entry(config: ConfigNode, section: str, name: Any) -> ConfigNode:
    """What the ``section`` entry ``name`` holds (a context, cluster or user), with the path of the
    kubeconfig that defines it; ConfigException (naming it) when there is none."""
    found = config[section].get_with_name(name)
    inner = found[section[:-1]] if found is not None else None
    if not isinstance(inner, ConfigNode):
        raise ConfigException(f"{section[:-1]} {name!r} is not a mapping")
    return inner


def _named_file(node: ConfigNode | None, key: str, where: str) -> str | None:
    """The file a kubeconfig section names for ``key``, relative to the kubeconfig that defines it."""
    value = node.safe_get(key) if node is not None else None
    if not value or node is None:
        return None
    path = Path(node.path or ".").parent / os.path.expanduser(str(value))
    if not path.is_file():
        raise ValueError(f"{where}: {key} {path} does not exist")
    return str(path)


def _in_cluster_url() -> str | None:
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        return None
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def _access(cfg: DiscoveryConfig) -> Access:
    """Blocking (reads files, may run an exec plugin): call it on a worker thread. Raises
    AccessError (or OSError for an unreadable namespace file). Modes, first match: ``api_url``,
    ``kubeconfig``, in-cluster, ``$KUBECONFIG``."""
    if cfg.kubeconfig is not None and cfg.api_url is None:
        return _kubeconfig_access(cfg, [cfg.kubeconfig])
    for field, message in check_files(cfg):  # a file removed since validation
        raise AccessError(field, message)
    if cfg.api_url is not None:
        url = cfg.api_url
        ca = cfg.ca_file if cfg.ca_file and Path(cfg.ca_file).is_file() else None
    elif (in_cluster := _in_cluster_url()) is not None:
        url = in_cluster
        # The service account's CA is the only one that verifies the API: missing means the
        # service account is not mounted (automountServiceAccountToken: false?).
        if cfg.ca_file and not Path(cfg.ca_file).is_file():
            raise AccessError(
                "ca_file",
                f"{cfg.ca_file} does not exist (in-cluster API access needs the service "
                "account's CA: is the service account token mounted?)",
            )
        ca = cfg.ca_file
    else:
        paths = [p for p in os.environ.get("KUBECONFIG", "").split(os.pathsep) if p]
        if not paths:
            raise AccessError(
                "api_url",
                "no api_url, KUBERNETES_SERVICE_HOST is not set (not in a pod?) and no "
                "kubeconfig (discovery.kubeconfig or $KUBECONFIG)",
            )
        if not (existing := [p for p in paths if Path(p).expanduser().is_file()]):  # kubectl skips missing ones
            raise AccessError("kubeconfig", f"$KUBECONFIG: none of {', '.join(paths)} exists")
        return _kubeconfig_access(cfg, existing)
    configuration = Configuration(host=url)
    configuration.ssl_ca_cert = ca
    _refresh_from_file(configuration, cfg.token_file)
    return Access(configuration, cfg.namespace or _read(cfg.namespace_file), cfg.token_file)


def _kubeconfig_access(cfg: DiscoveryConfig, paths: list[str]) -> Access:
    """Access from a kubeconfig, loaded by the library on this (worker) thread's own event loop: an
    exec plugin's first run, inline certificates written to private temporary files (removed at
    exit). A ``ca_file`` or ``token_file`` the config names explicitly wins."""
    try:
        kc = read_kubeconfig(paths)
        configuration = Configuration()
        asyncio.run(kc.loader.load_and_set(configuration))
    except (ValueError, ConfigException, OSError) as err:
        message = str(err) if cfg.kubeconfig else f"$KUBECONFIG: {err}"
        raise AccessError("kubeconfig", message) from None
    if (ca := _explicit(cfg, "ca_file")) is not None:
        if not Path(ca).is_file():
            raise AccessError("ca_file", f"{ca} does not exist")
        configuration.ssl_ca_cert = ca
    if not configuration.verify_ssl:
        log.warning(
            "discovery: kubeconfig cluster %s has insecure-skip-tls-verify: the API server's certificate is "
            "not verified",
            configuration.host,
        )
    token_file = _explicit(cfg, "token_file") or kc.token_file
    if token_file:
        _refresh_from_file(configuration, token_file)
    elif kc.exec_plugin and _BEARER in configuration.api_key:  # (a plugin may give a client certificate instead)
        configuration.refresh_api_key_hook = _exec_hook(kc.loader)
    return Access(configuration, cfg.namespace or kc.namespace or "default", token_file)


def _refresh_from_file(configuration: Configuration, token_file: str | None) -> None:
    """Bearer token from ``token_file``, re-read before every request (the client asks for its
    credential only when it has one: hence the placeholder)."""
    if not token_file:
        return
    configuration.api_key[_BEARER] = ""

    async def refresh(conf: Configuration) -> None:
        try:
            token = await asyncio.to_thread(_read, token_file)
        except OSError as err:
            raise AccessError("token_file", f"cannot read the token file {token_file} ({err.strerror})") from None
        if not token:
            raise AccessError("token_file", f"the token file {token_file} is empty")
        conf.api_key[_BEARER] = f"Bearer {token}"

    configuration.refresh_api_key_hook = refresh


def _exec_hook(loader: KubeConfigLoader) -> Callable[[Configuration], Awaitable[None]]:
    """The exec plugin's token, run again by the library when it nears its expiry."""

    async def refresh(conf: Configuration) -> None:
        await loader.load_from_exec_plugin()
        conf.api_key[_BEARER] = loader.token  # "Bearer <token>"

    return refresh
