# Sourced by scripts/test and scripts/demo: create or reuse .venv and install fxpipe into it.
# FXPIPE_TORCH overrides the torch requirement used when the venv has no torch yet
# (default: the CPU build torch==2.13.0); an existing torch, e.g. a CUDA build, is kept.
fxpipe_venv() {
    local extras="$1"
    local root venv stamp want
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    venv="$root/.venv"
    if [ ! -x "$venv/bin/python" ]; then
        echo "[fxpipe] creating $venv" >&2
        python3 -m venv "$venv"
    fi
    want="$extras $(cat "$root/setup.cfg" "$root/pyproject.toml" | cksum)"
    stamp="$venv/.fxpipe-installed"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        return 0
    fi
    if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
        echo "[fxpipe] installing ${FXPIPE_TORCH:-torch==2.13.0} (CPU build)" >&2
        "$venv/bin/python" -m pip install -q "${FXPIPE_TORCH:-torch==2.13.0}"
    fi
    echo "[fxpipe] installing fxpipe[$extras]" >&2
    "$venv/bin/python" -m pip install -q -e "$root[$extras]"
    echo "$want" > "$stamp"
}
