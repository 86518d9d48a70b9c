"""Check a resolved requirement set (a pip dry-run install report, JSON) against every declared constraint.

pip's resolver enforces the dependencies of what it installs, but not those declared under extras nobody asked
for: megatron-core declares its TransformerEngine range only under `[dev]`, so `megatron-core` plus
`transformer-engine` resolves to any TE, inside or outside that range. This reads the report and checks, for
every resolved package, each `Requires-Dist` whose marker holds for the extras that were requested, plus the
`WATCHED` ones under extras we do not install but whose constraint we rely on. It also lists what pip would
build from source (an sdist: the TE torch binding builds against whatever torch its build environment has).

Usage: python tools/check_requirements.py REPORT.json   (tools/check_requirements.sh makes the report)
Exit status 1 when a constraint is violated.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

WATCHED: dict[str, dict[str, tuple[str, ...]]] = {
    # package -> {extra not installed: the requirements under it that we rely on all the same}
    "megatron-core": {"dev": ("transformer-engine",)},  # its TE range lives only under [dev]
}


@dataclass(frozen=True)
class Finding:
    """One declared constraint on a resolved package: who declares it, and whether the resolved version fits."""

    declared_by: str
    requirement: str
    resolved: str
    ok: bool


def _marker_holds(req: Requirement, env: dict[str, str], extras: tuple[str, ...]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": e}) for e in (extras or ("",)))


def check_report(report: dict, env: dict[str, str] | None = None) -> tuple[list[Finding], list[str]]:
    """(constraints checked on resolved packages, packages built from source) for one pip install report.

    `env` is the marker environment (the report's own `environment` by default: the target interpreter).
    """
    env = dict(env or report.get("environment") or default_environment())
    resolved: dict[str, Version] = {}
    requested_extras: dict[str, tuple[str, ...]] = {}
    sdists: list[str] = []
    for item in report["install"]:
        meta = item["metadata"]
        name = canonicalize_name(meta["name"])
        resolved[name] = Version(meta["version"])
        requested_extras[name] = tuple(item.get("requested_extras") or ())
        url = item.get("download_info", {}).get("url", "")
        if not url.endswith(".whl"):
            sdists.append(f"{meta['name']} {meta['version']} ({url.rsplit('/', 1)[-1] or url})")
    findings: list[Finding] = []
    for item in report["install"]:
        meta = item["metadata"]
        name = canonicalize_name(meta["name"])
        watched = WATCHED.get(name, {})
        for spec in meta.get("requires_dist") or ():
            req = Requirement(spec)
            dep = canonicalize_name(req.name)
            extras = requested_extras[name] + tuple(e for e, deps in watched.items() if dep in deps)
            if dep not in resolved or not _marker_holds(req, env, extras):
                continue
            findings.append(Finding(f"{meta['name']} {meta['version']}", spec, f"{req.name} {resolved[dep]}",
                                    req.specifier.contains(resolved[dep], prereleases=True)))
    return findings, sdists


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[-2], file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        report = json.load(f)
    findings, sdists = check_report(report)
    bad = [f for f in findings if not f.ok]
    print(f"resolved {len(report['install'])} packages; {len(findings)} declared constraints on them checked")
    for name in ("torch", "megatron-core", "transformer-engine", "transformer-engine-torch", "sglang",
                 "torch-memory-saver", "sgl-kernel", "sglang-kernel", "flashinfer-python", "transformers"):
        hit = [i["metadata"]["version"] for i in report["install"]
               if canonicalize_name(i["metadata"]["name"]) == name]
        if hit:
            print(f"  {name:26s} {hit[0]}")
    for f in findings:
        if f.requirement.split(";")[0].replace(" ", "").startswith(("torch", "transformer-engine",
                                                                     "transformer_engine")):
            print(f"  {'ok ' if f.ok else 'BAD'} {f.declared_by:32s} requires {f.requirement:60s} "
                  f"resolved {f.resolved}")
    for s in sdists:
        print(f"  built from source: {s}")
    for f in bad:
        print(f"VIOLATION: {f.declared_by} requires {f.requirement!r}, resolved {f.resolved}")
    print("ok: every declared constraint holds" if not bad else f"{len(bad)} constraint(s) violated")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
