"""`xpu certs`: the site CA and the hosts' keys and certificates for the peer service's mutual TLS.

The CLI's main module adds the group with ``register(app)``. The work is ``xpud.federation.certs``
(imported when a command runs: the ``cryptography`` package is not needed by other commands).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

certs_app = typer.Typer(
    help="Make the site CA (`init`) and a key and certificate per host (`issue`) for peer mutual TLS.",
    no_args_is_help=True,
)


def _fail(message: str, code: int = 1):
    typer.echo(f"xpu: {message}", err=True)
    raise typer.Exit(code)


@certs_app.command("init")
def init(
    out: Annotated[Path, typer.Option("--out", help="Folder for ca.key (0600) and ca.crt.")],
    site: Annotated[str, typer.Option("--site", help="The site's name, in the CA's subject.")] = "xpud",
    force: Annotated[bool, typer.Option("--force", help="Replace a CA already in --out.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Make the site CA: every host's certificate is signed by it, and peers accept only its certificates."""
    from xpud.federation.certs import CertError, init_ca

    try:
        key, cert = init_ca(out, site=site, force=force)
    except CertError as e:
        _fail(str(e))
    if as_json:
        print(json.dumps({"key": str(key), "cert": str(cert)}))
        return
    print(f"site CA: {cert} (key {key}, 0600: keep it off the hosts; only ca.crt goes to them)")
    print(f"next: xpu certs issue HOST --ip IP --ca {out} --out DIR, for each host")


@certs_app.command("issue")
def issue(
    name: Annotated[str, typer.Argument(help="The host's name (its [cluster] name).")],
    ca: Annotated[Path, typer.Option("--ca", help="The folder `xpu certs init` wrote.")],
    out: Annotated[Path, typer.Option("--out", help="Folder for NAME.key (0600), NAME.crt and ca.crt.")],
    ip: Annotated[list[str] | None, typer.Option("--ip", help="An address peers use (repeat).")] = None,
    dns: Annotated[list[str] | None, typer.Option("--dns", help="A DNS name peers use (repeat).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace a key and certificate in --out.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """A key and certificate for one host, signed by the site CA."""
    from xpud.federation.certs import CertError
    from xpud.federation.certs import issue as issue_cert

    try:
        done = issue_cert(name, ca, out, ips=ip or [], dns=dns or [], force=force)
    except CertError as e:
        _fail(str(e))
    if as_json:
        print(
            json.dumps(
                {"key": str(done.key), "cert": str(done.cert), "ca": str(done.ca), "names": list(done.names)}
            )
        )
        return
    print(f"{name}: {done.cert} and {done.key} (0600), for {', '.join(done.names)}")
    print(f'[cluster] ca = "{done.ca}"  cert = "{done.cert}"  key = "{done.key}"')


def register(app: typer.Typer) -> None:
    """Add the ``certs`` group to the ``xpu`` application."""
    app.add_typer(certs_app, name="certs")
