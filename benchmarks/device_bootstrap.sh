#!/usr/bin/env bash
# On a device machine that reaches no package index: install what `python -m benchmarks.device_bundle` left in
# .whl/ (the service's and math_rl's packages the machine's image lacks, tinkerflow's own wheel, the temporal CLI
# xz-compressed) into a target folder, put it first on PYTHONPATH and PATH, and run the command given, e.g.
#
#   bash benchmarks/device_bootstrap.sh python3 -m benchmarks.device_stack --shape qwen3-8b
#
# TINKERFLOW_BUNDLE (default .whl) and TINKERFLOW_SITE (default /tmp/site) move the two folders.
set -euo pipefail
bundle=${TINKERFLOW_BUNDLE:-.whl}
site=${TINKERFLOW_SITE:-/tmp/site}
if [ ! -f "$bundle/temporal.xz" ]; then
  echo "no $bundle/temporal.xz: build the bundle first where PyPI is reachable (python -m benchmarks.device_bundle)" >&2
  exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$bundle"/*.whl
mkdir -p "$site/bin"
python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
  "$bundle/temporal.xz" "$site/bin/temporal"
chmod +x "$site/bin/temporal"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
exec "$@"
