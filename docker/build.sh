#!/usr/bin/env bash
# Builds the hetfed images with buildah, without a Docker engine and without pulling from a registry:
#   1. a local Debian base (debootstrap --variant=minbase with python3) imported as localhost/hetfed-base;
#   2. a local CPU torch base on it, unless --torch-base names one (a CUDA PyTorch image for GPU nodes);
#   3. localhost/hetfed-aggregator:<version> from docker/aggregator.Dockerfile (no torch);
#   4. localhost/hetfed-client:<version> from docker/client.Dockerfile on the torch base;
#   5. with `example` only: localhost/hetfed-client-example:<version>, an organization's own image from
#      docker/examples/own-code.Dockerfile (examples/hetfed_example on the client image; built first if missing).
# Usage: docker/build.sh [--torch-base IMAGE] [--torch-index URL] [aggregator|client|all|example]   (default all)
#   --torch-base IMAGE  an image that already holds torch, the client's BASE instead of the local CPU base
#                       (pulled by buildah). For GPU nodes a CUDA PyTorch image, for example
#                       docker/build.sh --torch-base docker.io/pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime client
#                       The environment variable HETFED_TORCH_BASE does the same; the flag wins.
#   --torch-index URL   the index the local CPU base installs torch from (default HETFED_TORCH_INDEX, else
#                       https://download.pytorch.org/whl/cpu: the public index's Linux torch is the CUDA build;
#                       an empty URL means pip's own default)
#   -h, --help          this text
# Environment:
#   HETFED_IMAGE_STORE  container storage directory (default build/images; vfs driver, no daemon)
#   HETFED_SUITE        Debian suite of the base (default bookworm: python 3.11)
#   HETFED_TORCH        pip requirement of the torch base (default torch==2.13.0)
#   HETFED_TORCH_BASE   as --torch-base
#   HETFED_TORCH_INDEX  as --torch-index
#   PIP_FIND_LINKS      a local wheel directory, mounted into the torch base build when it exists
#   HETFED_BUILD_CA     a CA bundle pip must trust inside the builds (a TLS-inspecting proxy); default
#                       $PIP_CERT or $SSL_CERT_FILE when set. It is mounted for the build only, never kept.
# Tools: buildah, podman, debootstrap and runc; run as root (apt-get installs them when missing).
# Push the results with `buildah --root ... push localhost/hetfed-aggregator:TAG docker://REGISTRY/...`.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,/^set -euo pipefail/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }
what=all
given_base=${HETFED_TORCH_BASE:-}
index=${HETFED_TORCH_INDEX-https://download.pytorch.org/whl/cpu}
while (($#)); do
  case $1 in
    -h | --help) usage; exit 0 ;;
    --torch-base | --torch-index)
      if (($# < 2)); then echo "docker/build.sh: $1 needs a value (docker/build.sh --help)" >&2; exit 2; fi
      if [[ $1 == --torch-base ]]; then given_base=$2; else index=$2; fi
      shift 2 ;;
    --torch-base=*) given_base=${1#*=}; shift ;;
    --torch-index=*) index=${1#*=}; shift ;;
    aggregator | client | all | example) what=$1; shift ;;
    *) echo "docker/build.sh: unknown argument '$1' (docker/build.sh --help)" >&2; exit 2 ;;
  esac
done
store=${HETFED_IMAGE_STORE:-$PWD/build/images}
suite=${HETFED_SUITE:-bookworm}
torch=${HETFED_TORCH:-torch==2.13.0}
version=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
base=localhost/hetfed-base:$suite
torch_base=${given_base:-localhost/hetfed-torch-base:$suite}
storage=(--root "$store/root" --runroot "$store/run" --storage-driver vfs)
ca=${HETFED_BUILD_CA:-${PIP_CERT:-${SSL_CERT_FILE:-}}}
ca_mount=()
ca_arg=()
if [[ -n $ca && -f $ca ]]; then
  ca_mount=(-v "$(realpath "$ca"):/run/hetfed-build-ca.crt:ro")
  ca_arg=(--build-arg PIP_CERT=/run/hetfed-build-ca.crt)
fi

step() { printf '== %s (%ss)\n' "$1" "$SECONDS"; }

missing=()
for tool in buildah podman debootstrap runc; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "docker/build.sh: missing ${missing[*]}: apt-get install -y --no-install-recommends buildah podman debootstrap runc" >&2
    exit 2
  fi
  step "installing ${missing[*]}"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends buildah podman debootstrap runc >/dev/null
fi
mkdir -p "$store"

has_image() { buildah "${storage[@]}" inspect --type image "$1" >/dev/null 2>&1; }

# The local Debian base carries the aggregator and the default torch base; a given torch base needs none.
if [[ $what == all || $what == aggregator || -z $given_base ]] && ! has_image "$base"; then
  step "debootstrap $suite into a minimal root filesystem"
  rootfs=$(mktemp -d "$store/rootfs.XXXXXX")
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$suite" "$rootfs" >/dev/null
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  chmod 755 "$rootfs"  # mktemp made it 0700: as the image's /, it would lock out every non-root user
  step "importing it as $base"
  tar -C "$rootfs" -c . | podman "${storage[@]}" import - "$base" >/dev/null
  rm -rf "$rootfs"
fi

if [[ $what == all || $what == aggregator ]]; then
  step "building localhost/hetfed-aggregator:$version"
  buildah "${storage[@]}" bud --isolation chroot --layers=false --pull=never --build-arg BASE="$base" \
    "${ca_mount[@]}" "${ca_arg[@]}" -f docker/aggregator.Dockerfile -t "localhost/hetfed-aggregator:$version" . >"$store/aggregator.log"
fi

client=localhost/hetfed-client:$version
if [[ $what == all || $what == client ]] || { [[ $what == example ]] && ! has_image "$client"; }; then
  # A given base is the user's image: buildah pulls it if needed; only the default one is made here.
  if [[ -z $given_base ]] && ! has_image "$torch_base"; then
    step "making $torch_base ($torch)"
    ctr=$(buildah "${storage[@]}" from --pull=never "$base")
    mounts=("${ca_mount[@]}")
    if ((${#ca_mount[@]})); then
      mounts+=(--env PIP_CERT=/run/hetfed-build-ca.crt)
    fi
    links=${PIP_FIND_LINKS:-}
    if [[ -n $links && -d $links ]]; then
      mounts+=(-v "$links:/wheels:ro" --env PIP_FIND_LINKS=/wheels)
    fi
    # torch goes into the system's site-packages (/usr/local), where a --system-site-packages venv sees it;
    # a throw-away venv provides pip, so the base keeps no pip of its own.
    buildah "${storage[@]}" run --isolation chroot "${mounts[@]}" "$ctr" -- sh -c \
      'site=$(python3 -c "import sys; print(\"/usr/local/lib/python%d.%d/dist-packages\" % sys.version_info[:2])") \
       && python3 -m venv /tmp/pip \
       && /tmp/pip/bin/pip install --quiet --no-cache-dir --target "$site" ${1:+--index-url "$1"} "$0" \
       && rm -rf /tmp/pip' "$torch" "$index"
    buildah "${storage[@]}" commit --rm "$ctr" "$torch_base" >/dev/null
  fi
  step "building localhost/hetfed-client:$version"
  # A local base must come from this store: never pulled, so a missing one fails here, not at localhost's door.
  pull=(--pull=never)
  [[ -n $given_base ]] && pull=()
  buildah "${storage[@]}" bud --isolation chroot --layers=false "${pull[@]}" --build-arg BASE="$torch_base" \
    "${ca_mount[@]}" "${ca_arg[@]}" -f docker/client.Dockerfile -t "localhost/hetfed-client:$version" . >"$store/client.log"
fi

if [[ $what == example ]]; then
  step "building localhost/hetfed-client-example:$version"
  buildah "${storage[@]}" bud --isolation chroot --layers=false --pull=never --build-arg BASE="$client" \
    --build-arg CHECK=hetfed_example.models:resnet "${ca_mount[@]}" "${ca_arg[@]}" \
    -f docker/examples/own-code.Dockerfile -t "localhost/hetfed-client-example:$version" examples/hetfed_example \
    >"$store/example.log"
fi

step "done"
buildah "${storage[@]}" images
