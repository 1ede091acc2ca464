#!/usr/bin/env bash
# Install the peer systems bench/peers.py compares kvpool with. Optional: the
# benchmark reports a missing peer as "skipped: not installed", and no test
# needs any of them. Run as root (or with sudo) from the repository root:
#
#     bash bench/install_peers.sh            # redis, mooncake, lmcache
#     bash bench/install_peers.sh redis      # only some of them
#
# - redis:    Debian redis-server (started by the benchmark itself, never as a
#             service) + the Python client `redis`.
# - mooncake: `mooncake-transfer-engine-non-cuda` (mooncake_master,
#             mooncake_client, the `mooncake.store` module); its shared objects
#             need Debian libibverbs1 even when only TCP is used.
# - lmcache:  `lmcache` (lmcache_server + Python client) in its own venv,
#             $KVPOOL_LMCACHE_VENV (default ~/.cache/kvpool-peers/lmcache-venv),
#             because its dependencies would break the project venv. It needs
#             torch: the CPU build of the project venv is reused, or pip pulls
#             a multi-GB CUDA one.
set -euo pipefail

cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
# LMCache lives in its own venv (see below); bench/peers.py looks for it here.
LMCACHE_VENV="${KVPOOL_LMCACHE_VENV:-$HOME/.cache/kvpool-peers/lmcache-venv}"
PEERS=("$@")
[ ${#PEERS[@]} -gt 0 ] || PEERS=(redis mooncake lmcache)

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"

apt_packages=()
for peer in "${PEERS[@]}"; do
    case "$peer" in
        redis) apt_packages+=(redis-server) ;;
        mooncake) apt_packages+=(libibverbs1) ;;
        lmcache) ;;
        *) echo "unknown peer: $peer (known: redis mooncake lmcache)" >&2; exit 2 ;;
    esac
done

if [ ${#apt_packages[@]} -gt 0 ]; then
    $SUDO apt-get update -q
    # --no-install-recommends: no init scripts beyond the package's own; the
    # benchmark starts redis-server itself on a free 127.0.0.1 port.
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${apt_packages[@]}"
fi

for peer in "${PEERS[@]}"; do
    case "$peer" in
        redis) "$PY" -m pip install -q "redis[hiredis]" ;;
        mooncake)
            "$PY" -m pip install -q mooncake-transfer-engine-non-cuda
            # bench/hicache_bench.py runs SGLang's MooncakeStore in SGLang's venv (.ci/run makes it)
            if [ -x .venv-sglang/bin/python ]; then
                .venv-sglang/bin/python -m pip install -q mooncake-transfer-engine-non-cuda
            fi ;;
        lmcache)
            # Its own venv, never the project's: lmcache pulls cupy-cuda13x,
            # cuda-bindings 13 (ucxx-cu12's rmm needs < 13) and numba, which
            # downgrades numpy. The venv sees the project venv's packages
            # through a .pth placed after its own site-packages, so the CPU
            # torch already there satisfies lmcache (a plain install pulls a
            # multi-GB CUDA build) while lmcache's pins shadow, not replace.
            "$PY" -c 'import torch' 2>/dev/null || "$PY" -m pip install -q torch==2.13.0
            torch_version="$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
            "$PY" -m venv "$LMCACHE_VENV"
            lm_site="$("$LMCACHE_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
            "$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$lm_site/zz-kvpool-venv.pth"
            "$LMCACHE_VENV/bin/python" -m pip install -q lmcache "torch==$torch_version" ;;
    esac
done

LMCACHE_VENV="$LMCACHE_VENV" "$PY" - <<'PY'
import importlib.util, os, shutil
for name, ok in [("redis-server", shutil.which("redis-server")),
                 ("redis (python)", importlib.util.find_spec("redis")),
                 ("mooncake.store", importlib.util.find_spec("mooncake")),
                 ("lmcache venv", os.path.exists(os.environ["LMCACHE_VENV"] + "/bin/lmcache_server"))]:
    print(f"{name:16s} {'ok' if ok else 'missing'}")
PY
