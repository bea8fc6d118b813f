#!/usr/bin/env bash
# QuACK (quack-kernels 0.6.5, nvidia-cutlass-dsl 4.8.1) for the bench's `quack` rows, from wheels in one folder:
#   bash benchmarks/install_quack.sh WHEEL_DIR [TARGET]      (TARGET default /tmp/quack/site-packages)
# prints the PYTHONPATH entries to add, or fails naming the wheels its tree lacks. A wheel too large for one transfer
# may come as split(1) parts NAME.part.aa, NAME.part.ab, ...: they are joined first (NAME: the wheel's file name, or
# any name, then read from the wheel's own metadata). Two traps (../shared/INTEGRATION-NOTES.md): QuACK wants a path holding
# /site-packages/, and nvidia-cutlass-dsl's .pth file does not run from a --target folder, so its
# dsl_packages folder goes on PYTHONPATH too.
set -euo pipefail
src=${1:?usage: install_quack.sh WHEEL_DIR [TARGET]}
target=${2:-/tmp/quack/site-packages}
case "$target" in */site-packages*) ;; *) echo "TARGET must hold /site-packages/ (QuACK's rule)" >&2; exit 2 ;; esac
work=$(mktemp -d)
cp "$src"/*.whl "$work"/ 2>/dev/null || true
for first in "$src"/*.part.aa; do
  [ -e "$first" ] || continue
  joined="$work/$(basename "${first%.part.aa}")"
  cat "${first%.aa}"* > "$joined"
  case "$joined" in
    *.whl) ;;
    *) mv "$joined" "$work/$(python3 -c '
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
wheel = next(n for n in z.namelist() if n.endswith(".dist-info/WHEEL"))
tag = next(l.split(": ", 1)[1] for l in z.read(wheel).decode().splitlines() if l.startswith("Tag: "))
print(wheel.split(".dist-info/")[0] + "-" + tag + ".whl")' "$joined")" ;;
  esac
done
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$target" "$work"/*.whl >&2
rm -rf "$work"
# each wheel installs a part of one tree: a part left out surfaces only as an import error at QuACK's first call
missing=""
[ -f "$target/quack/linear_cross_entropy.py" ] || missing="$missing quack-kernels"
[ -d "$target/nvidia_cutlass_dsl/dsl_packages/cutlass/cutlass_dsl" ] || missing="$missing nvidia-cutlass-dsl-libs-core"
[ -d "$target/nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir" ] || missing="$missing nvidia-cutlass-dsl-libs-base"
if [ -n "$missing" ]; then
  echo "install_quack.sh: QuACK will not import from $target: no wheel of${missing} in $src" >&2
  exit 1
fi
echo "$target:$target/nvidia_cutlass_dsl/dsl_packages"
