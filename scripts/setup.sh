#!/usr/bin/env bash
# Installs everything libtorch-fsdp needs on a fresh Debian machine; safe to run again.
#
#   - Debian packages: a compiler, CMake, Ninja, ccache, GoogleTest, fmt, Gloo's headers,
#     nlohmann/json (header-only, used inside the checkpoint library).
#   - LibTorch: the PyPI torch==2.11.0 wheel in a virtualenv kept in a per-user cache keyed by
#     the torch version, so fresh clones reuse it instead of downloading gigabytes again.
#
# Prints the virtualenv's path on its last line. Environment:
#   FSDP_VENV       where the virtualenv lives (default: ~/.cache/libtorch-fsdp/venv-torch-2.11.0)
#   FSDP_SKIP_APT=1 do not touch Debian packages (e.g. without root)
set -euo pipefail

TORCH_VERSION=2.11.0
cache_root="${XDG_CACHE_HOME:-$HOME/.cache}/libtorch-fsdp"
venv="${FSDP_VENV:-$cache_root/venv-torch-$TORCH_VERSION}"
log() { echo "[setup] $*" >&2; }

# --- Debian packages -------------------------------------------------------------------------
debs=(g++ cmake ninja-build ccache libgtest-dev libfmt-dev libgloo-dev nlohmann-json3-dev python3-venv)
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})) && [[ "${FSDP_SKIP_APT:-0}" != 1 ]]; then
  log "installing Debian packages: ${missing[*]}"
  sudo=""; [[ $(id -u) -ne 0 ]] && sudo="sudo"
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >&2
elif ((${#missing[@]})); then
  log "warning: missing Debian packages (FSDP_SKIP_APT=1): ${missing[*]}"
fi

# --- LibTorch from the torch wheel -----------------------------------------------------------
have_torch() {
  [[ -x "$venv/bin/python" ]] &&
    "$venv/bin/python" -c "import torch,sys; sys.exit(0 if torch.__version__.split('+')[0]=='$TORCH_VERSION' else 1)" 2>/dev/null
}
if ! have_torch; then
  log "creating $venv with torch==$TORCH_VERSION (several GB on first use; cached afterwards)"
  mkdir -p "$(dirname "$venv")"
  # A lock so that two clones setting up at once do not both install into one virtualenv.
  exec 9>"$(dirname "$venv")/.setup.lock"
  flock 9
  if ! have_torch; then
    [[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip >&2
    "$venv/bin/python" -m pip install -q "torch==$TORCH_VERSION" numpy >&2
  fi
  flock -u 9
fi
# Python's safetensors, for the tests that open the checkpoint files from Python (never the library).
SAFETENSORS_VERSION=0.8.0
have_safetensors() {
  "$venv/bin/python" -c "import safetensors,sys; sys.exit(0 if safetensors.__version__=='$SAFETENSORS_VERSION' else 1)" 2>/dev/null
}
if ! have_safetensors; then
  log "installing safetensors==$SAFETENSORS_VERSION into $venv"
  exec 9>"$(dirname "$venv")/.setup.lock"
  flock 9
  have_safetensors || "$venv/bin/python" -m pip install -q "safetensors==$SAFETENSORS_VERSION" >&2
  flock -u 9
fi
# Python's transformers, for the tests that compare the C++ Llama with LlamaForCausalLM (never the
# library). Every package it brings is pinned, so that the reference does not move under the tests.
TRANSFORMERS_VERSION=5.25.0
TRANSFORMERS_PINS=(transformers==$TRANSFORMERS_VERSION huggingface_hub==2.4.0 tokenizers==0.23.3 hf-xet==1.8.0
  click==8.5.1 httpx2==2.16.2 httpcore2==2.16.2 kernels==0.19.1 anyio==4.16.0 h11==0.16.0 idna==3.20
  packaging==26.4 PyYAML==6.0.4 regex==2026.11.19 tomlkit==0.15.3 tqdm==4.70.1 truststore==0.10.5 typer==0.29.2
  annotated-doc==0.0.7 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 rich==15.0.0
  Pygments==2.21.0 markdown-it-py==4.3.0 mdurl==0.1.2 shellingham==1.5.4 typing-inspection==0.4.5)
have_transformers() {
  "$venv/bin/python" -c "import transformers,sys; sys.exit(0 if transformers.__version__=='$TRANSFORMERS_VERSION' else 1)" 2>/dev/null
}
if ! have_transformers; then
  log "installing transformers==$TRANSFORMERS_VERSION (and its pinned dependencies) into $venv"
  exec 9>"$(dirname "$venv")/.setup.lock"
  flock 9
  have_transformers || "$venv/bin/python" -m pip install -q "${TRANSFORMERS_PINS[@]}" >&2
  flock -u 9
fi
log "torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null) in $venv"
echo "$venv"
