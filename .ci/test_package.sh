#!/usr/bin/env bash
# Test one package in isolation: build its wheel (and the wheels of the mg packages it
# declares), install them into a virtual environment that holds only those wheels and their
# declared dependencies (plus the package's `test` extra), and run tests/<import_name> there.
# A test that imports an undeclared package fails here.
set -euo pipefail
cd "$(dirname "$0")/.."
pkg="$1"
shift  # the rest are pytest arguments
# Run quietly; on failure show pip's output (minus the mirror's noise about absent pages).
quiet() { local out; if ! out=$("$@" 2>&1); then echo "$out" | grep -v 'is ignored: it is neither' >&2; return 1; fi; }
dev=.venv/bin/python
dist=dist/$pkg
venv=.venvs/$pkg

# Transitive closure of mg siblings named in the package's pyproject.
needed=("$pkg")
queue=("$pkg")
while ((${#queue[@]})); do
  cur=${queue[0]}; queue=("${queue[@]:1}")
  for dep in $(grep -o '"mg-[a-z]*' "packages/$cur/pyproject.toml" | tr -d '"' | sort -u); do
    [[ "$dep" == "$cur" ]] && continue
    if [[ ! " ${needed[*]} " =~ " $dep " ]]; then needed+=("$dep"); queue+=("$dep"); fi
  done
done

rm -rf "$dist"; mkdir -p "$dist"
for p in "${needed[@]}"; do
  quiet $dev -m pip wheel -q --no-deps --no-build-isolation "packages/$p" -w "$dist"
done

# Recreate the venv when any involved pyproject or the constraints change.
key=$(cat constraints.txt $(for p in "${needed[@]}"; do echo "packages/$p/pyproject.toml"; done) | sha256sum | cut -c1-16)
if [[ ! -f "$venv/.key" || "$(cat "$venv/.key")" != "$key" ]]; then
  rm -rf "$venv"
  python3 -m venv "$venv" 2>/dev/null || .venv/bin/python -m venv --without-pip "$venv"
  quiet "$venv/bin/python" -m pip install -q --upgrade pip
  fresh=1
else
  fresh=0
fi
main_whl=$(ls "$dist"/$(echo "$pkg" | tr - _)-*.whl)
others=()
for f in "$dist"/*.whl; do [[ "$f" != "$main_whl" ]] && others+=("$f"); done
# The largest third-party requirements (torch, transformers) are unpacked once into a shared
# directory per constraints file, and each venv whose packages declare them gets that directory on
# its path through a .pth file, so pip sees them as installed. A venv whose packages do not
# declare them does not get the directory, so isolation is what it was.
shared() {
  local req="$1" dir=".venvs/_shared/$1-$(cat constraints.txt | sha256sum | cut -c1-12)"
  if [[ ! -f "$dir/.done" ]]; then
    rm -rf "$dir"
    quiet $dev -m pip install -q -c constraints.txt --target "$dir" "$req"
    touch "$dir/.done"
  fi
  local site
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$(cd "$dir" && pwd)" > "$site/_mg_shared_$req.pth"
}
for req in torch transformers; do
  # declared in a [project] dependencies list of a needed package, or in this package's test extra
  if grep -q "^dependencies = .*\"$req[>=<\"]" $(for p in "${needed[@]}"; do echo "packages/$p/pyproject.toml"; done) ||
     grep -q "^test = .*\"$req[>=<\"]" "packages/$pkg/pyproject.toml"; then
    shared "$req"
  fi
done
quiet "$venv/bin/python" -m pip install -q -c constraints.txt --force-reinstall --no-deps "$main_whl" "${others[@]}"
quiet "$venv/bin/python" -m pip install -q -c constraints.txt "${main_whl}[test]" "${others[@]}"
echo "$key" > "$venv/.key"

imp=$(echo "$pkg" | tr - _)
echo "== $pkg (isolated: ${needed[*]}; fresh venv: $fresh)"
mkdir -p .ci-reports
"$venv/bin/python" -m pytest -q -p no:cacheprovider --junitxml=".ci-reports/$pkg.xml" "tests/$imp" "$@"
