"""The installed distribution: version and declared dependencies."""

import importlib.metadata as md
import re

import mg_parallel


def test_version_matches_metadata():
    assert mg_parallel.__version__ == md.version("mg-parallel")


def test_siblings_are_minimum_versions_not_pins():
    for req in md.requires("mg-parallel") or []:
        if req.startswith("mg-"):
            spec = req.split(";")[0]
            assert ">=" in spec and "==" not in spec, req


def test_depends_on_torch_only():
    runtime = [r for r in md.requires("mg-parallel") or [] if "extra ==" not in r]
    assert [re.split(r"[<>=!~ ;\[]", r)[0] for r in runtime] == ["torch"]
