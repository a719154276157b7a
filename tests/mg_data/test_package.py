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


def test_import_does_not_pull_torch_or_tqdm():
    import subprocess
    import sys

    code = "import sys, mg_data, mg_data.preprocess; print(sorted(m for m in ('torch', 'tqdm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
