#!/usr/bin/env bash
# Install the carry bundle and this checkout into a target folder, as on the GPU test machine:
#
#   bash scripts/device/install_bundle.sh [BUNDLE] [SITE]    # defaults: out/device_bundle /tmp/oscar-site
#   (BUNDLE as built, its tarball unpacked into SITE.bundle, or a folder scripts/device/unpack_bundle.py filled)
#   source scripts/device/server_env.sh SITE                   # then: python -m sglang.launch_server ...
#
# No network, no dependency resolution: the bundle's wheels (scripts/device/build_bundle.py), then this
# project and the sgl_kernel stand-in (scripts/sgl_kernel_standin) built from source with the machine's
# own setuptools, all with --target SITE. Installed with their metadata, because SGLang finds plugins
# through entry points. A SITE this script filled from the same bundle, source and Python is kept as it is
# (its stamp file says so). Used by scripts/device_check.sh on the device and scripts/device/dry_run.sh here.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bundle=${1:-$root/out/device_bundle}
site=${2:-/tmp/oscar-site}
py=${PYTHON:-python3}
if [ ! -d "$bundle/wheels" ] && [ -f "$bundle/bundle.tar.xz" ]; then   # as built: unpack it beside SITE
  "$py" "$root/scripts/device/unpack_bundle.py" "$bundle" "$site.bundle"
  bundle=$site.bundle
fi
if [ ! -d "$bundle/wheels" ]; then
  echo "no bundle at $bundle (build it with: bash scripts/device/build_bundle.sh)" >&2
  exit 1
fi
pip=("$py" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir
     --upgrade --target "$site")
# Build from copies: building in place would leave build/ and *.egg-info in the checkout.
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
git -C "$root" ls-files -z --cached --others --exclude-standard 2>/dev/null | (cd "$root" && xargs -0 cp --parents -t "$src") \
  || cp -r "$root"/. "$src"
# What this install is made of: the Python, the bundle (bundle.json holds every wheel's sha256) and the source.
# A folder an earlier run on this machine filled from the same is used as it is (a rerun on the warm device
# machine: the step took 5 s instead of 10 s in the dry run); one filled from anything else is emptied first.
stamp=$( { "$py" -c 'import sys; print(sys.version)'; cat "$bundle/bundle.json" 2>/dev/null;
           (cd "$src" && find . -type f -print0 | sort -z | xargs -0 sha256sum); } | sha256sum | cut -d' ' -f1)
stamp_file=$site/.oscar-install-stamp
if [ "$(cat "$stamp_file" 2>/dev/null)" = "$stamp" ]; then
  echo "[install] reusing $site: installed by an earlier run from the same bundle, source and Python"
else
  [ -f "$stamp_file" ] && rm -rf "$site"   # ours, from another bundle or source
  "${pip[@]}" "$bundle"/wheels/*.whl
  "${pip[@]}" --no-build-isolation "$src" "$src/scripts/sgl_kernel_standin"
  mkdir -p "$site" && echo "$stamp" > "$stamp_file"
fi
echo "[install] $(ls "$site" | grep -c dist-info) distributions in $site"
# Check from a neutral directory (the checkout's oscar_sglang/ folder must not shadow the installed one).
cd / && PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" "$py" - "$site" <<'EOF'
import sys
from importlib.metadata import entry_points
import sglang, sgl_kernel, oscar_sglang.kernels.api, oscar_sglang.sglang.plugin
site = sys.argv[1]
plugins = sorted(e.name for e in entry_points(group="sglang.srt.plugins"))
where = {m.__name__: m.__file__ for m in (sglang, sgl_kernel, oscar_sglang.kernels.api)}
print(f"[install] sglang {sglang.__version__}; plugins {plugins}; " + ", ".join(f"{k} from {v}" for k, v in where.items()))
assert all(f.startswith(site) for f in where.values()), where
assert {"oscar_int2", "no_cutedsl_dual_gemm"} <= set(plugins), plugins
EOF
