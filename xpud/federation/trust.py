"""What a peer's certificate buys on this host: the checks ``hostjobs`` makes on every Peer call.

A site certificate proves only which host calls (its common name). So:

- **No root from elsewhere**: a job of uid 0 is refused from other hosts unless this host's
  ``[cluster] allow_root_jobs = true``; this host's own jobs are its own root's business.
- **A job is its coordinator's**: the host that reserved a job here (the ``coordinator`` of its
  reservation) is the only one whose Commit, Launch and Abort of it are taken, and no other host may
  reserve it again while it is held or committed.
- The gid and groups a rank runs with come from this host's user database (``rankproc.host_groups``),
  never from the caller.
"""

from __future__ import annotations

from xpud.errors import Forbidden


def caller(peer: str | None, here: str) -> str:
    """Who asks: the peer's certificate name, or this host for its own jobs (``peer`` None or empty)."""
    return peer or here


def remote(peer: str | None, here: str) -> bool:
    return bool(peer) and peer != here


def root_jobs_allowed(cluster) -> bool:
    """``[cluster] allow_root_jobs`` (``cluster`` None: no [cluster] config, so false)."""
    return cluster is not None and cluster.allow_root_jobs


def check_uid(uid: int, peer: str | None, here: str, cluster) -> None:
    """Raise Forbidden for a job of uid 0 from another host, unless this host allows root jobs."""
    if uid == 0 and remote(peer, here) and not root_jobs_allowed(cluster):
        raise Forbidden(
            f"host {here} takes no root (uid 0) jobs from other hosts ([cluster] allow_root_jobs = false "
            f"there): run the job as a user, or set allow_root_jobs = true on {here}"
        )


def check_coordinator(job: str, coordinator: str, peer: str | None, here: str, what: str) -> None:
    """Raise Forbidden unless the caller is the host that reserved ``job`` here (``coordinator``; "" for
    an entry no host owns yet)."""
    who = caller(peer, here)
    if coordinator and coordinator != who:
        raise Forbidden(
            f"job {job} on host {here} was reserved by host {coordinator}: host {who} may not {what} it "
            "(only the coordinating host may)"
        )
