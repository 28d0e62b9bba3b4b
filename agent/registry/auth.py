"""Authentication to one registry host, for ``RegistryClient``.

A 401's ``WWW-Authenticate`` challenge says how: HTTP Basic (the credentials go
with every request from then on), or the Bearer token flow Harbor and
distribution use (a token fetched from the challenge's realm, checked, and cached
per repository scope: one repository's token is never sent for another's).
The credentials go only to this registry's own host or to a token service the
admin named.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Mapping

from tfimage.agent.core.errors import RegistryError, VerificationError
from tfimage.agent.core.logtext import oneline
from tfimage.agent.registry.credentials import Credential
from tfimage.agent.registry.transport import (
    RedirectRefused,
    Response,
    Transport,
    TransportError,
    brief,
    read_capped,
)

_CHALLENGE = re.compile(r'(\w+)="([^"]*)"')
# What a token may be: it goes into a header line, so nothing that could end one.
_TOKEN = re.compile(r"[A-Za-z0-9._~+/=-]{1,16384}\Z")


class HostAuth:
    """What one registry host asked for, and the tokens it gave, by scope."""

    def __init__(
        self,
        host: str,
        credential: Credential | None,
        *,
        transport: Transport,
        projects: Mapping[str, Credential] | None = None,
        timeout: tuple[float, float],
        verify: str | bool,
        token_realms: tuple[str, ...] = (),
    ) -> None:
        self.host = host
        self._cred = credential
        # Credentials for repositories under a path (credentials.py's host/project
        # keys, the host stripped): a project's own robot.
        self._projects = dict(projects or {})
        self._transport = transport
        self._timeout = timeout
        self._verify = verify
        self._tokens: dict[str, str] = {}
        self._basic = False
        # Token services the credentials may go to, by host and port: this
        # registry's own, and those the admin allowed (config token_realms, where a
        # host without a port means 443).
        self._realms = {_host_port(host), *(_host_port(r) for r in token_realms)}

    def bearer(self, scope: str) -> str | None:
        """The ``Authorization`` header for ``scope``, once its token is fetched."""
        token = self._tokens.get(scope)
        return f"Bearer {token}" if token is not None else None

    def credential(self, repository: str) -> Credential | None:
        """The credential for ``repository``: its project's, else the host's."""
        parts = repository.split("/") if repository else []
        for n in range(len(parts), 0, -1):
            if (cred := self._projects.get("/".join(parts[:n]))) is not None:
                return cred
        return self._cred

    def _for_scope(self, scope: str) -> Credential | None:
        kind, _, rest = scope.partition(":")
        return self.credential(rest.rpartition(":")[0] if kind == "repository" else "")

    def basic(self, scope: str = "") -> tuple[str, str] | None:
        """The credentials to send as Basic auth, once the registry asked for them."""
        cred = self._for_scope(scope)
        return (cred.username, cred.password) if self._basic and cred else None

    def answer(self, resp: Response, scope: str) -> None:
        """Meet a 401's challenge, so that the request sent again is authorized."""
        challenge = resp.headers.get("WWW-Authenticate", "")
        kind = challenge.split(" ", 1)[0].lower()
        cred = self._for_scope(scope)
        if kind == "basic":
            if not cred:
                raise RegistryError(f"{self.host}: requires credentials and none are configured")
            self._basic = True
            return
        if kind != "bearer":
            raise RegistryError(f"{self.host}: unsupported auth challenge {kind!r}")
        params = dict(_CHALLENGE.findall(challenge))
        realm = params.get("realm")
        if not realm or not realm.startswith("https://"):
            raise RegistryError(f"{self.host}: bearer realm must be https")
        realm_host = _host_port(urllib.parse.urlsplit(realm).netloc)
        if cred and realm_host not in self._realms:
            # The password goes to the registry's own host, or a token service the
            # admin named; a registry's answer never sends it elsewhere.
            raise RegistryError(
                f"{self.host}: its token service is on another host "
                f"({oneline(realm_host, 80)}); not sending it the credentials "
                "(an admin may allow it: token_realms in the config)"
            )
        query = {"service": params.get("service", ""), "scope": params.get("scope", scope)}
        self._tokens[scope] = self._fetch_token(realm, query, cred)

    def _fetch_token(self, realm: str, query: dict[str, str], cred: Credential | None) -> str:
        auth = (cred.username, cred.password) if cred else None
        sep = "&" if "?" in realm else "?"
        try:
            with self._transport.request(
                "GET",
                realm + sep + urllib.parse.urlencode(query),
                headers={},
                auth=auth,
                timeout=self._timeout,
                verify=self._verify,
            ) as tok:
                if tok.status_code != 200:
                    raise RegistryError(f"{self.host}: token service refused ({tok.status_code})")
                raw = read_capped(tok, 1 << 20, "token")
        except RedirectRefused as e:
            raise RegistryError(f"{self.host}: token service: {brief(e)}") from None
        except TransportError as e:
            raise RegistryError(f"{self.host}: token service unreachable: {brief(e)}") from None
        except VerificationError:
            raise RegistryError(f"{self.host}: token service sent too much") from None
        try:
            body = json.loads(raw)
            token = body.get("token") or body["access_token"]
        except (ValueError, KeyError, AttributeError):
            raise RegistryError(f"{self.host}: token service sent no token") from None
        if not isinstance(token, str) or not _TOKEN.match(token):
            raise RegistryError(f"{self.host}: token service sent an unusable token")
        return token


def _host_port(netloc: str) -> str:
    """``host:port`` of a registry or realm (port 443 when none is given)."""
    parts = urllib.parse.urlsplit(f"//{netloc}")
    try:
        port = parts.port or 443
    except ValueError:
        port = 0
    return f"{parts.hostname or netloc}:{port}"
