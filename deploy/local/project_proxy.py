#!/usr/bin/env python3
"""The nginx configuration of a per-project auth proxy in front of a registry.

Debian's ``docker-registry`` has one htpasswd for every repository; Harbor gives
each project its own robot accounts.  This puts Debian's nginx in front of an
unauthenticated registry on a private port, with one ``location`` and one htpasswd
per project (the distribution project's own "authenticate proxy with nginx"
recipe, a location per project), so that a project's robot reads its project and
the site's robot reads the rest but not that project.  Used by the local cluster
(deploy/local/proxy.sh) and by the unit tests' fixture; stdlib only.

    python3 project_proxy.py [--as-site=HOST:PORT] LISTEN UPSTREAM CERT KEY WORKDIR \\
        SITE_HTPASSWD [PROJECT=HTPASSWD ...] > nginx.conf

``--as-site`` adds a plain-HTTP listener (on loopback) that reads as the site's
robot does, without asking for it: every project's own repositories refused, the
rest served.  It is the upstream of the local rack mirror (deploy/local/mirror.sh),
whose docker-registry 2.8 proxy sends its credentials only to a Bearer token
service, never as Basic auth.
"""

from __future__ import annotations

import re
import sys

_PROJECT = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}\Z")
_HOSTPORT = re.compile(r"[A-Za-z0-9.-]+:[0-9]{1,5}\Z")


def _location(path: str, realm: str, htpasswd: str, upstream: str) -> str:
    return f"""
        location {path} {{
            auth_basic "{realm}";
            auth_basic_user_file {htpasswd};
            add_header Docker-Distribution-Api-Version registry/2.0 always;
            proxy_pass http://{upstream};
            proxy_set_header Host $http_host;
            proxy_set_header X-Forwarded-Proto $scheme;
            proxy_set_header X-Real-IP $remote_addr;
            proxy_read_timeout 900;
            proxy_request_buffering off;
            proxy_buffering off;
        }}"""


def nginx_conf(
    listen: str,
    upstream: str,
    cert: str,
    key: str,
    workdir: str,
    site_htpasswd: str,
    projects: dict[str, str],
    as_site: str | None = None,
) -> str:
    """nginx.conf text: TLS on ``listen``, proxying to ``upstream`` (host:port);
    ``/v2/<project>/`` behind that project's htpasswd, everything else behind the
    site's."""
    for hp in (listen, upstream, *([as_site] if as_site else [])):
        if not _HOSTPORT.match(hp):
            raise ValueError(f"not host:port: {hp!r}")
    for project in projects:
        if not _PROJECT.match(project):
            raise ValueError(f"not a project name: {project!r}")
    locations = "".join(_location(f"/v2/{p}/", p, h, upstream) for p, h in sorted(projects.items()))
    return f"""# a per-project auth proxy (deploy/local/project_proxy.py)
user root;
worker_processes 1;
daemon off;
pid {workdir}/nginx.pid;
error_log {workdir}/error.log warn;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {workdir}/body;
    proxy_temp_path {workdir}/proxy;
    fastcgi_temp_path {workdir}/fastcgi;
    uwsgi_temp_path {workdir}/uwsgi;
    scgi_temp_path {workdir}/scgi;
    client_max_body_size 0;
    chunked_transfer_encoding on;
    server {{
        listen {listen} ssl;
        ssl_certificate {cert};
        ssl_certificate_key {key};
{locations}
{_location("/v2/", "registry", site_htpasswd, upstream)}
    }}{_as_site(as_site, upstream, projects) if as_site else ""}
}}
"""


def _as_site(listen: str, upstream: str, projects: dict[str, str]) -> str:
    refused = "".join(
        f"""
        location /v2/{p}/ {{ return 403; }}"""
        for p in sorted(projects)
    )
    return f"""
    server {{
        listen {listen};{refused}
        location /v2/ {{
            add_header Docker-Distribution-Api-Version registry/2.0 always;
            proxy_pass http://{upstream};
            proxy_set_header Host $http_host;
            proxy_read_timeout 900;
            proxy_buffering off;
        }}
    }}"""


def main(argv: list[str]) -> int:
    as_site = next((a.split("=", 1)[1] for a in argv if a.startswith("--as-site=")), None)
    argv = [a for a in argv if not a.startswith("--as-site=")]
    if len(argv) < 6:
        print(__doc__, file=sys.stderr)
        return 2
    listen, upstream, cert, key, workdir, site = argv[:6]
    projects = dict(a.split("=", 1) for a in argv[6:])
    sys.stdout.write(nginx_conf(listen, upstream, cert, key, workdir, site, projects, as_site))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
