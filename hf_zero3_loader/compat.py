"""Untested transformers and DeepSpeed releases (docs/compatibility.md, "What happens on an untested version").

- At `import hf_zero3_loader`: a transformers or DeepSpeed outside the tested releases
  (`_transformers_private.TESTED_RANGE`, `_deepspeed_private.TESTED_RANGE`) is named in one warning (rank 0, once per
  process). Nothing fails.
- At the first load (and the first save): every private hook the package touches (`HOOKS` in the two modules) is
  checked once, with the shape the package relies on. A load that needs one that is missing or changed goes through
  transformers' own ZeRO-3 path instead (`loader.py`), slower but the same model; a save is refused (`saving.py`).
"""

from __future__ import annotations

from . import _deepspeed_private as ds_private
from . import _transformers_private as hf_private
from . import log
from ._hooks import CLI, EP, LOAD, SAVE, SIMULATE_ENV, TESTS  # noqa: F401  (the uses, for callers)

DOC = "docs/compatibility.md"


def installed_version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _tested(version: str, tested_range: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(version).release
    except InvalidVersion:
        return False
    low, high = tested_range
    return low <= release < high


TESTED = {"transformers": (hf_private.TESTED_RANGE, " and ".join(hf_private.TRANSFORMERS_VERSIONS_CHECKED)),
          "deepspeed": (ds_private.TESTED_RANGE, ds_private.DEEPSPEED_VERSION_WRITTEN_AGAINST)}


def untested_versions() -> list[str]:
    """"transformers 5.26.0 (tested: 5.23 and 5.24)" for each of transformers and DeepSpeed installed outside its
    tested releases."""
    out = []
    for package, (tested_range, label) in TESTED.items():
        version = installed_version(package)
        if version is not None and not _tested(version, tested_range):
            out.append(f"{package} {version} (tested: {label})")
    return out


def warn_if_untested() -> None:
    """At import: one line, on rank 0, once per process, for an untested transformers or DeepSpeed. Never raises."""
    try:
        untested = untested_versions()
        if untested:
            log.warning_once(f"untested {untested}",
                             "hf_zero3_loader runs on untested versions: %s. The private hooks it needs are checked "
                             "at the first load; where one is missing, loads go through transformers' own ZeRO-3 "
                             "path (slower, the same model). See %s.", "; ".join(untested), DOC)
    except Exception:  # a warning about versions must not be what breaks an import
        pass


def missing_hooks(*uses: str) -> list[str]:
    """"name: what is wrong" for each private hook of transformers or DeepSpeed that `uses` need (LOAD, SAVE, EP, ...;
    all when none given) and the installed versions lack or have changed. Checked once per process."""
    return hf_private.missing_hooks(*uses) + ds_private.missing_hooks(*uses)


def versions() -> str:
    return f"transformers {installed_version('transformers')}, DeepSpeed {installed_version('deepspeed')}"


def describe(missing: list[str]) -> str:
    return f"{versions()} lack(s) or changed private hooks hf_zero3_loader needs: {'; '.join(missing)}"


def forget() -> None:
    """Check the hooks again at the next call (tests)."""
    from ._hooks import forget as forget_hooks

    forget_hooks()
