"""Shared fixtures: real tools, no mocks.

- ``make_sif`` builds a real SIF (mksquashfs + siftool) from a directory tree.
- ``registry`` starts a real CNCF distribution registry (Debian's docker-registry)
  on 127.0.0.1 with a CA made here, TLS and bcrypt htpasswd auth;
- ``token_registry`` another, behind Harbor-style token auth: ``token_service``
  (tokenauth.py) issues the JWTs, which the registry itself verifies.

The skip budget (skipbudget.py) is loaded here: in strict mode (``.ci/run``) a skip
outside its short, reviewed list fails the run.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests

from support import TEAM_ROBOT, Registry, build_sif, need
from tokenauth import ISSUER, SERVICE, TokenService, signing_cert

pytest_plugins = ["skipbudget"]


@pytest.fixture
def make_sif(tmp_path: Path) -> Callable[[dict[str, str]], Path]:
    need("mksquashfs", "siftool")
    count = 0

    def build(files: dict[str, str]) -> Path:
        nonlocal count
        count += 1
        root = tmp_path / f"rootfs{count}"
        for rel, content in files.items():
            p = root / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(content)
        return build_sif(root, tmp_path / f"img{count}.sif")

    return build


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA made here and a server certificate for 127.0.0.1 (ca.crt, srv.crt, srv.key)."""
    need("openssl")
    d = tmp_path_factory.mktemp("tls")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=test CA",
        "-keyout",
        str(d / "ca.key"),
        "-out",
        str(d / "ca.crt"),
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    )
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        str(d / "srv.key"),
        "-out",
        str(d / "srv.csr"),
    )
    # localhost too: the same server under another host name, for what must not
    # follow a request to another host (credentials, tokens).
    (d / "ext.cnf").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"
    )
    openssl(
        "x509",
        "-req",
        "-in",
        str(d / "srv.csr"),
        "-CA",
        str(d / "ca.crt"),
        "-CAkey",
        str(d / "ca.key"),
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        str(d / "ext.cnf"),
        "-out",
        str(d / "srv.crt"),
    )
    return d


@contextlib.contextmanager
def _serve_registry(d: Path, tls: Path, auth: str) -> Iterator[str]:
    """A docker-registry on a free 127.0.0.1 port with ``auth`` (a YAML mapping),
    storing under ``d``; yields its host:port once it answers 401."""
    host = f"127.0.0.1:{_free_port()}"
    (d / "config.yml").write_text(
        "version: 0.1\nlog: {level: error}\n"
        f"storage: {{filesystem: {{rootdirectory: {d / 'data'}}}, delete: {{enabled: true}}}}\n"
        f"http: {{addr: '{host}', "
        f"tls: {{certificate: {tls / 'srv.crt'}, key: {tls / 'srv.key'}}}}}\n"
        f"auth: {auth}\n"
    )
    proc = subprocess.Popen(
        ["docker-registry", "serve", str(d / "config.yml")],
        stdout=subprocess.DEVNULL,
        stderr=(d / "log").open("w"),
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                code = requests.get(
                    f"https://{host}/v2/", verify=str(tls / "ca.crt"), timeout=1
                ).status_code
                if code == 401:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"registry did not start: {(d / 'log').read_text()[-500:]}")
            time.sleep(0.1)
        yield host
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


ROBOT = ("robot$library+test", "s3cret-pass")  # a Harbor project robot account's name


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory, tls: Path) -> Iterator[Registry]:
    need("docker-registry", "htpasswd")
    d = tmp_path_factory.mktemp("registry")
    user, password = ROBOT
    htp = subprocess.run(
        ["htpasswd", "-Bbn", user, password], check=True, capture_output=True, timeout=60
    ).stdout.decode()
    (d / "htpasswd").write_text(htp)
    auth = f"{{htpasswd: {{realm: test, path: {d / 'htpasswd'}}}}}"
    with _serve_registry(d, tls, auth) as host:
        yield Registry(host, tls / "ca.crt", user, password)


@pytest.fixture(scope="session")
def token_service(tmp_path_factory: pytest.TempPathFactory, tls: Path) -> Iterator[TokenService]:
    need("openssl")
    d = tmp_path_factory.mktemp("token")
    key, crt = signing_cert(d)
    service = TokenService(tls, key, crt, *ROBOT, project="library")
    try:
        yield service
    finally:
        service.close()


@pytest.fixture(scope="session")
def token_registry(
    tmp_path_factory: pytest.TempPathFactory, tls: Path, token_service: TokenService
) -> Iterator[Registry]:
    """A registry behind Harbor-style token auth: the registry checks real JWTs."""
    need("docker-registry")
    d = tmp_path_factory.mktemp("token-registry")
    auth = (
        f"{{token: {{realm: '{token_service.realm}', service: {SERVICE}, "
        f"issuer: {ISSUER}, rootcertbundle: {token_service.crt}}}}}"
    )
    realm = urlsplit(token_service.realm).netloc  # another port of the same host
    with _serve_registry(d, tls, auth) as host:
        yield Registry(host, tls / "ca.crt", *ROBOT, token_realms=(realm,))


@pytest.fixture(scope="session")
def fake_nvml_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fake libnvidia-ml.so.1 (tests/fakenvml), built once; its directory."""
    from gpus import build_fake_nvml

    return build_fake_nvml(tmp_path_factory.mktemp("fakenvml"))


def _project_proxy() -> Callable[..., str]:
    """deploy/local/project_proxy.py's nginx_conf, the one the local cluster uses."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "deploy/local/project_proxy.py"
    spec = importlib.util.spec_from_file_location("project_proxy", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.nginx_conf  # type: ignore[no-any-return]


def _htpasswd(path: Path, user: str, password: str) -> Path:
    out = subprocess.run(["htpasswd", "-Bbn", user, password], check=True,
                         capture_output=True, timeout=60).stdout  # fmt: skip
    path.write_bytes(out)
    return path


@pytest.fixture(scope="session")
def project_registry(tmp_path_factory: pytest.TempPathFactory, tls: Path) -> Iterator[Registry]:
    """A registry behind Debian's nginx with a robot per project: ``team-a/`` reads
    only with TEAM_ROBOT, everything else only with ROBOT (the ``Registry``'s)."""
    need("docker-registry", "htpasswd", "nginx")
    d = tmp_path_factory.mktemp("project-registry")
    upstream = f"127.0.0.1:{_free_port()}"
    (d / "config.yml").write_text(
        "version: 0.1\nlog: {level: error}\n"
        f"storage: {{filesystem: {{rootdirectory: {d / 'data'}}}, delete: {{enabled: true}}}}\n"
        f"http: {{addr: '{upstream}'}}\n"
    )
    host = f"127.0.0.1:{_free_port()}"
    conf = _project_proxy()(
        host,
        upstream,
        str(tls / "srv.crt"),
        str(tls / "srv.key"),
        str(d),
        str(_htpasswd(d / "site.htpasswd", *ROBOT)),
        {"team-a": str(_htpasswd(d / "team-a.htpasswd", *TEAM_ROBOT))},
    )
    (d / "nginx.conf").write_text(conf)
    with contextlib.ExitStack() as stack:
        for argv, log in (
            (["docker-registry", "serve", str(d / "config.yml")], "registry.log"),
            (["nginx", "-c", str(d / "nginx.conf"), "-p", str(d)], "nginx.out"),
        ):
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=(d / log).open("w"))
            stack.callback(_stop, proc)
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"https://{host}/v2/", verify=str(tls / "ca.crt"),
                                timeout=1).status_code == 401:  # fmt: skip
                    break
            if time.monotonic() > deadline:
                logs = "".join(p.read_text()[-300:] for p in d.glob("*.log"))
                raise RuntimeError(f"project proxy did not start: {logs}")
            time.sleep(0.1)
        yield Registry(host, tls / "ca.crt", *ROBOT)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
