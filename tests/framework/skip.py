"""The skip policy: a missing prerequisite fails the test naming it, unless KILN_ALLOW_SKIPS=1
asks for a skip instead (pytest shows skips with `-rs`)."""

import os
import shutil

import pytest

ALLOW_SKIPS = "KILN_ALLOW_SKIPS"


def skips_allowed() -> bool:
    return os.environ.get(ALLOW_SKIPS) == "1"


def need(ok: bool, why: str):
    """Returns when `ok`; otherwise skips (KILN_ALLOW_SKIPS=1) or fails the test, naming `why`."""
    if ok:
        return
    if skips_allowed():
        pytest.skip(why)
    pytest.fail(f"{why} ({ALLOW_SKIPS}=1 skips this test instead)")


def need_root(what: str):
    """`what` (e.g. "network namespaces") needs root."""
    need(os.geteuid() == 0, f"{what} need root")


def need_tools(*programs: str, hint: str = ""):
    """Every one of `programs` is on PATH; `hint` says how to install them."""
    missing = [p for p in programs if shutil.which(p) is None]
    need(not missing, f"{', '.join(missing)} not installed" + (f" ({hint})" if hint else ""))
