"""The installed distribution: version and declared dependencies."""

import importlib.metadata as md

import mg_data


def test_version_matches_metadata():
    assert mg_data.__version__ == md.version("mg-data")


def test_siblings_are_minimum_versions_not_pins():
    for req in md.requires("mg-data") or []:
        if req.startswith("mg-"):
            spec = req.split(";")[0]
            assert ">=" in spec and "==" not in spec, req
