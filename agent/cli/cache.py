"""``tfimage cache ...``: the operator's view of one node's image cache.

Exit statuses are exits.py's; ``verify`` exits 1 (STATE) when an entry is bad,
``warm`` when a kept image could not be fetched.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tfimage.agent.cli import exits
from tfimage.agent.core.config import Config, load_config
from tfimage.agent.core.errors import InputError, TfimageError

if TYPE_CHECKING:  # every `tfimage` call builds this parser: load the cache only when used
    from tfimage.agent.cache.pull import Puller
    from tfimage.agent.cache.store import ImageCache

Handler = Callable[[argparse.Namespace], int]


def _cache(args: argparse.Namespace) -> ImageCache:
    from tfimage.agent.cache.store import ImageCache

    cfg = load_config(args.config)
    return ImageCache(cfg.staging() if getattr(args, "stage", False) else cfg)


def _puller(cache: ImageCache) -> Puller:
    from tfimage.agent.cache.pull import Puller

    return Puller(cache)


MIN_PREFIX = 4


def _digest_of(cache: ImageCache, cfg: Config, what: str) -> str:
    """A cached entry named by digest (or a unique prefix of one) or by reference:
    exactly one, or nothing is done."""
    entries = cache.entries()
    if what.startswith("sha256:"):
        if len(what) < len("sha256:") + MIN_PREFIX:
            raise InputError(f"{what!r}: give at least {MIN_PREFIX} hex digits of the digest")
        hits = [e.digest for e in entries if e.digest.startswith(what)]
    else:
        ref = cfg.reference(what)
        if ref.digest:
            hits = [ref.digest] if cache.path_of(ref.digest).exists() else []
        else:
            name = f"{ref.name}:{ref.tag}"
            hits = [e.digest for e in entries if name in e.refs]
    if len(hits) != 1:
        raise InputError(f"{what!r} names {'no' if not hits else 'more than one'} cached image")
    return hits[0]


def _out(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, sort_keys=True) if args.json else text)


def _may_run(cfg: Config, origin: str | None, uid: int) -> bool:
    """Whether ``uid`` may run images pulled as ``origin`` (``host/repository``)."""
    from tfimage.agent.core.access import check
    from tfimage.agent.core.errors import AccessDenied

    try:
        check(cfg.access, (origin or "").partition("/")[2], uid)
    except AccessDenied:
        return False
    return True


def cmd_ls(args: argparse.Namespace) -> int:
    cache = _cache(args)
    entries = cache.entries()
    uid = os.geteuid()
    if cache.cfg.access and uid != 0:
        # A user lists only what they may run (core/access.py); root lists everything.
        entries = [e for e in entries if _may_run(cache.cfg, e.origin, uid)]
    if args.json:
        print(json.dumps([e.to_json() for e in entries], sort_keys=True))
        return 0
    # -v: where each entry's bytes came from (a registry, a mirror, or "staged": a copy
    # staged for a job) and the repository they were pulled as (kernel-mount trust).
    verbose = getattr(args, "verbose", False)
    extra = f"  {'SOURCE':<21}  {'ORIGIN':<30}" if verbose else ""
    print(
        f"{'DIGEST':<19}  {'SIZE':>9}  {'LAST USED':<19}  {'KEEP':<4}  {'HELD BY':<10}{extra}  REFS"
    )
    for e in sorted(entries, key=lambda e: -e.last_used):
        used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.last_used))
        size = f"{e.size / (1 << 20):.1f}M"
        held = ",".join(e.holders) or "-"
        keep = "yes" if e.kept else "-"
        where = f"  {e.source or '-':<21}  {e.origin or '-':<30}" if verbose else ""
        print(
            f"{e.digest[:19]:<19}  {size:>9}  {used:<19}  {keep:<4}  {held:<10}{where}  "
            f"{', '.join(e.refs)}"
        )
    return 0


def cmd_du(args: argparse.Namespace) -> int:
    from tfimage.agent.cache.evict import fill

    cache = _cache(args)
    f = fill(cache)
    cfg = cache.cfg
    data = {
        "cache_bytes": f.cache_bytes,
        "entries": f.entries,
        "limit_bytes": f.limit_bytes,
        "used_percent": round(f.percent, 2),
        "high_watermark": cfg.cache_high_watermark,
        "low_watermark": cfg.cache_low_watermark,
    }
    _out(
        args,
        data,
        f"{f.cache_bytes / (1 << 20):.1f} MiB in {f.entries} image(s); "
        f"{f.percent:.1f}% of {f.limit_bytes / (1 << 30):.1f} GiB used "
        f"(prune starts at {cfg.cache_high_watermark:g}%, "
        f"stops at {cfg.cache_low_watermark:g}%)",
    )
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from tfimage.agent.cache.evict import remove

    cache = _cache(args)
    digest = _digest_of(cache, cache.cfg, args.image)
    remove(cache, digest, force=args.force)
    _out(args, {"removed": digest}, f"removed {digest}")
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    from tfimage.agent.cache.evict import orphans, prune, stale_partials

    cache = _cache(args)
    gone = prune(cache, dry_run=args.dry_run)
    partials = stale_partials(cache, dry_run=args.dry_run)
    lost = orphans(cache, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    lines = [f"{verb} {g.digest} ({', '.join(g.refs)})" for g in gone]
    lines += [f"{verb} {p.name} (left by an interrupted pull)" for p in partials]
    lines += [f"{verb} {p.name} (an orphan: half of an entry)" for p in lost]
    _out(
        args,
        {
            "dry_run": args.dry_run,
            "removed": [g.digest for g in gone],
            "partials": [p.name for p in partials],
            "orphans": [p.name for p in lost],
        },
        "\n".join(lines) or "nothing to prune",
    )
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from tfimage.agent.cache.verify import verify

    bad = verify(_cache(args))
    _out(
        args,
        [{"digest": d, "problem": p} for d, p in bad],
        "\n".join(f"BAD {d}: {p}" for d, p in bad) or "all cached images verified",
    )
    return 1 if bad else 0


def _keep(args: argparse.Namespace, keep: bool) -> int:
    from tfimage.agent.cache.keep import change_kept_refs, set_kept

    cache = _cache(args)
    cfg = cache.cfg
    if keep:
        ref = cfg.reference(args.image)
        got = _puller(cache).ensure(ref)
        assert got.ref.digest
        set_kept(cache, got.ref.digest, True)
        change_kept_refs(cache, lambda refs: [*refs, str(ref)])
        _out(args, {"kept": str(got.ref)}, f"kept {got.ref}")
        return 0
    digest = _digest_of(cache, cfg, args.image)
    named = {r for e in cache.entries() if e.digest == digest for r in e.refs}
    if not args.image.startswith("sha256:"):
        named.add(str(cfg.reference(args.image)))

    def names_it(text: str) -> bool:
        # Every kept name of this image goes, however it was given: else the next
        # `cache warm` would keep it again.
        try:
            kept = cfg.reference(text)
        except TfimageError:
            return False
        return kept.digest == digest or str(kept) in named or f"{kept.name}:{kept.tag}" in named

    change_kept_refs(cache, lambda refs: [r for r in refs if not names_it(r)])
    set_kept(cache, digest, False)
    _out(args, {"unkept": digest}, f"unkept {digest}")
    return 0


def cmd_warm(args: argparse.Namespace) -> int:
    """For a timer, and a new node before it takes jobs: fetch every kept image, the
    site's (``keep_images``) and this node's (a kept tag that moved brings its new
    bytes)."""
    from tfimage.agent.cache.keep import kept_refs, set_kept

    cache = _cache(args)
    pull = _puller(cache)
    failed = 0
    rows = []
    # The site's (config) and the operator's (this node's keep list), each once.
    for text in dict.fromkeys((*cache.cfg.keep_images, *kept_refs(cache))):
        try:
            got = pull.ensure(cache.cfg.reference(text))
            assert got.ref.digest
            set_kept(cache, got.ref.digest, True)
            rows.append({"ref": text, "digest": got.ref.digest, "hit": got.hit})
        except TfimageError as e:
            failed += 1
            rows.append({"ref": text, "error": str(e)})
            print(f"tfimage: warm {text}: {e}", file=sys.stderr)
    _out(
        args,
        rows,
        "\n".join(
            f"{r['ref']}: {'cached' if r.get('hit') else 'fetched'} {r['digest']}"
            for r in rows
            if "digest" in r
        )
        or "no kept images",
    )
    return 1 if failed else 0


EXIT_CODES = exits.EPILOG
_IMAGE = "a cached image: reference (tf-custom:2.0), digest, or a unique digest prefix"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], pull: Handler) -> None:
    c = sub.add_parser(
        "cache", help="inspect and manage this node's image cache", epilog=EXIT_CODES
    )
    c.add_argument(
        "--stage",
        action="store_true",
        help="the controller's staging cache (stage_dir: one pull per multi-node job) "
        "instead of this node's",
    )
    csub = c.add_subparsers(dest="cache_command", required=True, metavar="ACTION")

    def add(name: str, handler: Handler, help_: str) -> argparse.ArgumentParser:
        p = csub.add_parser(name, help=help_, description=help_, epilog=EXIT_CODES)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(func=handler)
        return p

    add("ls", cmd_ls, "list cached images: size, last use, kept, holding jobs, refs").add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also where each image's bytes came from (a registry, a mirror, or staged) "
        "and the repository they were pulled as",
    )
    add("pull", pull, "pull an image into the cache").add_argument(
        "ref", help="image reference, e.g. tf-custom:2.0 or project/name@sha256:..."
    )
    rm = add("rm", cmd_rm, "remove an image (never one a running job holds)")
    rm.add_argument("image", help=_IMAGE)
    rm.add_argument("--force", action="store_true", help="remove even if kept")
    pr = add("prune", cmd_prune, "evict least recently used images down to the low watermark")
    pr.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")

    def keep(a: argparse.Namespace) -> int:
        return _keep(a, True)

    def unkeep(a: argparse.Namespace) -> int:
        return _keep(a, False)

    keep_help = "pull an image and keep it (never evicted, fetched again by warm)"
    add("keep", keep, keep_help).add_argument(
        "image", help="image reference to pull and keep, e.g. tf-custom:2.0"
    )
    add("unkeep", unkeep, "let an image be evicted again, and warm fetch it no more").add_argument(
        "image", help=_IMAGE
    )
    add("verify", cmd_verify, "re-check every image's sha256 and SIF magic")
    add("du", cmd_du, "cache size and how full its filesystem is, against the watermarks")
    add("warm", cmd_warm, "fetch every kept image (for a timer or cron)")
